"""Attention with an additive bias that depends only on (head, j - i), read from a per-distance table [nh, 2L - 1].

The references. `reference64` is the dense math per sequence in float64: softmax(q k^T * scale + B) v with
B[h, i, j] = table[h, clamp(j - i + L - 1, 0, 2L - 2)], its index written out element by element (not through the
code under test). On padded rows it adds HF eager's finfo.min key mask after the bias, as MPNet's attention does.
The twin (fastbert/twins.py) is held to it in fp32; the kernel (kernels/attention.py, under Triton's interpreter on
CPU) to the twin and to it, with the rule of fastbert.numerics (fp32 1e-5; fp16 at most twice the twin's own error).
Outputs are poisoned with NaN first. The MPNet table is checked against transformers' own position bias.
"""
import pytest
import torch
from helpers import DEVICE, poisoned

from fastbert import dispatch, ops, twins
from fastbert.kernels.attention import attention, uniform_cu_seqlens
from fastbert.layout import TokenLayout
from fastbert.mask import AttentionMask
from fastbert.numerics import error_bound, max_error
from fastbert.relative import relative_bias_table
from fastbert.units.attention import Extras

RAGGED = (1, 31, 33, 65, 100)  # across the interpreter tile's 32-key and 64-query block edges


# --------------------------------------------------------------------------------------------------------------------
# Inputs and the fp64 reference
# --------------------------------------------------------------------------------------------------------------------
def make_packed(lengths, nh, hd, dtype, seed=0, strided=False):
    """qkv [T, 3, nh, hd] ~ N(0, 1) for sequences of `lengths` packed back to back, and their TokenLayout.
    strided: qkv is a column slice of a wider buffer (row stride 3H + 16), as a view of a bigger GEMM output."""
    T, H = sum(lengths), nh * hd
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(T, 3 * H, generator=g, dtype=torch.float64).to(dtype)
    if strided:
        big = torch.zeros(T, 3 * H + 16, dtype=dtype, device=DEVICE)
        big[:, 8:8 + 3 * H] = values
        flat = big[:, 8:8 + 3 * H]
    else:
        flat = values.to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return flat.view(T, 3, nh, hd), TokenLayout.from_cu_seqlens(cu, max(lengths), list(lengths))


def make_table(nh, max_len, seed=1, gain=2.0):
    """A float32 table [nh, 2 * max_len - 1] with O(gain) entries: big enough to move every softmax visibly."""
    g = torch.Generator().manual_seed(seed)
    return (gain * torch.randn(nh, 2 * max_len - 1, generator=g)).to(DEVICE)


def dense_bias64(table, n):
    """[nh, n, n] float64: B[h, i, j] = table[h, clamp(j - i + L - 1, 0, 2L - 2)], indexed one element at a time."""
    reach = (table.shape[1] - 1) // 2
    index = torch.tensor([[min(max(j - i + reach, 0), 2 * reach) for j in range(n)] for i in range(n)])
    return table.double().cpu()[:, index]


def reference64(qkv, lengths, scale, table, key_mask=None):
    """Per sequence: softmax(q k^T * scale + B [+ finfo.min on masked keys]) v in float64 -> [T, nh*hd].
    key_mask [n, S] (padded rows): HF eager's mask, added after the bias; a fully padded row attends uniformly."""
    T, _, nh, hd = qkv.shape
    x = qkv.double().cpu()
    out, start = torch.empty(T, nh * hd, dtype=torch.float64), 0
    for row, n in enumerate(lengths):
        q, k, v = x[start:start + n].permute(1, 2, 0, 3).unbind(0)  # [nh, n, hd]
        scores = q @ k.transpose(-1, -2) * scale
        if table is not None:
            scores = scores + dense_bias64(table, n)
        if key_mask is not None:
            masked = key_mask[row].cpu() == 0
            scores = scores + torch.zeros(n, dtype=torch.float64).masked_fill(masked, torch.finfo(torch.float64).min)
        out[start:start + n] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, nh * hd)
        start += n
    return out


def assert_kernel_ok(out, twin, ref64, dtype):
    assert out.dtype == dtype and out.shape == twin.shape == ref64.shape
    assert torch.isfinite(out).all(), "NaN/inf in the kernel output (an unwritten element keeps its NaN poison)"
    err = max_error(out, ref64)
    if dtype == torch.float32:
        assert max_error(out, twin) <= error_bound(dtype, 0.0), f"kernel vs twin: {max_error(out, twin):.3g}"
        assert err <= error_bound(dtype, 0.0), f"kernel vs fp64: {err:.3g}"
    else:
        twin_err = max_error(twin, ref64)
        assert err <= error_bound(dtype, twin_err), f"kernel error {err:.3g} vs twin error {twin_err:.3g}"


# --------------------------------------------------------------------------------------------------------------------
# The twin
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("table_len", [1, 40, 100, 130], ids=lambda n: f"L{n}")
def test_twin_varlen_matches_fp64(table_len):
    """Ragged packed sequences, a table shorter than the longest sequence (distances past it clamp), exactly as
    long, and longer; L = 1 is a constant per head (softmax ignores it)."""
    nh, hd = 3, 32
    qkv, layout = make_packed(RAGGED, nh, hd, torch.float32, strided=True)
    table, scale = make_table(nh, table_len), hd ** -0.5
    out = ops.attention_varlen_torch(qkv, layout, scale, bias=table)
    assert max_error(out, reference64(qkv, RAGGED, scale, table)) <= 1e-5
    ctx, probs = ops.attention_torch(qkv, layout, scale, bias=table)
    assert probs is None and torch.equal(ctx, out)


def test_twin_uniform_layout_matches_fp64():
    """Equal lengths take the twin's dense path: one [1, nh, S, S] bias shared by the batch."""
    nh, hd, B, S = 2, 32, 3, 45
    qkv, _ = make_packed([S] * B, nh, hd, torch.float32)
    layout = TokenLayout.dense(B, S, DEVICE)
    assert layout.uniform
    table, scale = make_table(nh, 30), hd ** -0.5
    out = ops.attention_varlen_torch(qkv, layout, scale, bias=table)
    assert max_error(out, reference64(qkv, [S] * B, scale, table)) <= 1e-5


def padded_case(B=3, S=70, nh=2, hd=32, dtype=torch.float32, seed=0):
    """qkv [B*S, ...] and a key mask [B, S]: row 0 right-padded, row 1 fully padded, row 2 left-padded with a hole."""
    qkv, _ = make_packed([S] * B, nh, hd, dtype, seed=seed)
    key_mask = torch.ones(B, S, dtype=torch.long, device=DEVICE)
    key_mask[0, 40:] = 0
    key_mask[1] = 0
    key_mask[2, :25] = 0
    key_mask[2, 50] = 0
    return qkv, key_mask


@pytest.mark.parametrize("return_probs", [False, True], ids=["sdpa", "probs"])
def test_twin_padded_matches_fp64(return_probs):
    """The padded twin (padding_free=False, output_attentions) with a bias: distances are padded positions, the
    fully padded row stays uniform, and the probabilities (when asked) are the reference's."""
    B, S, nh, hd = 3, 70, 2, 32
    qkv, key_mask = padded_case(B, S, nh, hd)
    mask = AttentionMask.build(key_mask, B, S, torch.float32)
    table, scale = make_table(nh, 50), hd ** -0.5
    ctx, probs = ops.attention_padded_torch(qkv, mask, scale, return_probs=return_probs, bias=table)
    ref = reference64(qkv, [S] * B, scale, table, key_mask)
    assert max_error(ctx, ref) <= 1e-5
    assert (probs is not None) == return_probs
    if return_probs:
        assert probs.shape == (B, nh, S, S)
        assert max_error(probs[1], torch.full((nh, S, S), 1.0 / S)) <= 1e-7


# --------------------------------------------------------------------------------------------------------------------
# The kernel (interpreter on CPU)
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("hd", [32, 64], ids=lambda d: f"hd{d}")
@pytest.mark.parametrize("table_len", [40, 130], ids=lambda n: f"L{n}")
def test_kernel_varlen_matches_twin_and_fp64(dtype, hd, table_len):
    """Packed ragged sequences in one launch; a 40-entry reach clamps the 100-token sequence's far distances."""
    nh = 2
    qkv, layout = make_packed(RAGGED, nh, hd, dtype, strided=hd == 64)
    table, scale = make_table(nh, table_len), hd ** -0.5
    out = poisoned((layout.num_tokens, nh * hd), dtype)
    result = attention(qkv, layout.cu_seqlens, layout.max_seqlen, scale, out=out, bias=table)
    assert result.data_ptr() == out.data_ptr()
    twin = ops.attention_varlen_torch(qkv, layout, scale, bias=table)
    assert_kernel_ok(out, twin, reference64(qkv, RAGGED, scale, table), dtype)


def test_kernel_table_of_one_distance_and_non_contiguous_table():
    """L = 1 (one column: every distance clamps to it) and a table that is a row slice of a wider buffer (row
    stride > 2L - 1; only the columns must be unit-stride)."""
    nh, hd, lengths = 2, 32, (33, 5)
    qkv, layout = make_packed(lengths, nh, hd, torch.float32)
    scale = hd ** -0.5
    wide = make_table(nh, 60)
    for table in (make_table(nh, 1), wide[:, 10:10 + 2 * 20 - 1]):
        assert table.stride(-1) == 1
        out = attention(qkv, layout.cu_seqlens, layout.max_seqlen, scale, bias=table,
                        out=poisoned((layout.num_tokens, nh * hd), torch.float32))
        twin = ops.attention_varlen_torch(qkv, layout, scale, bias=table)
        assert_kernel_ok(out, twin, reference64(qkv, lengths, scale, table), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernel_padded_matches_twin_and_fp64(dtype):
    """The key-mask variant with a bias (padding_free=False): right, left and holed rows, and a fully padded row,
    which stays HF eager's uniform average (finfo.min swamps the bias there)."""
    B, S, nh, hd = 3, 70, 2, 64
    qkv, key_mask = padded_case(B, S, nh, hd, dtype)
    mask = AttentionMask.build(key_mask, B, S, dtype)
    table, scale = make_table(nh, 50), hd ** -0.5
    out = attention(qkv, uniform_cu_seqlens(B, S, qkv.device), S, scale, key_valid=mask.key_valid, bias=table,
                    out=poisoned((B * S, nh * hd), dtype))
    twin, _ = ops.attention_padded_torch(qkv, mask, scale, bias=table)
    assert_kernel_ok(out, twin, reference64(qkv, [S] * B, scale, table, key_mask), dtype)


def test_kernel_bias_is_shift_invariant_under_packing():
    """A sequence's output does not depend on where it sits in the packed batch (distances are within a sequence)."""
    nh, hd = 2, 32
    qkv, layout = make_packed((65, 33), nh, hd, torch.float32)
    table, scale = make_table(nh, 70), hd ** -0.5
    packed = attention(qkv, layout.cu_seqlens, layout.max_seqlen, scale, bias=table)
    alone, alone_layout = qkv[65:], make_packed((33,), nh, hd, torch.float32)[1]
    single = attention(alone, alone_layout.cu_seqlens, 33, scale, bias=table)
    assert max_error(single, packed[65:]) <= 1e-6


@pytest.mark.parametrize("bad,error,words", [
    (lambda t: t.half(), TypeError, ["torch.float16", "float32"]),
    (lambda t: t[:1], ValueError, ["(1, 79)", "(2, an odd width)"]),
    (lambda t: t[:, :78], ValueError, ["(2, 78)"]),
    (lambda t: t[0], ValueError, ["(79,)"]),
    (lambda t: t.to("meta"), ValueError, ["meta"]),
    (lambda t: torch.randn(2, 158, device=t.device)[:, ::2], ValueError, ["(158, 2)"]),
    (lambda t: t.tolist(), TypeError, ["list"]),
], ids=["fp16", "heads", "even", "1-D", "device", "strided", "list"])
def test_kernel_refuses_bad_tables(bad, error, words):
    nh, hd = 2, 32
    qkv, layout = make_packed((5,), nh, hd, torch.float32)
    with pytest.raises(error) as info:
        attention(qkv, layout.cu_seqlens, 5, hd ** -0.5, bias=bad(make_table(nh, 40)))
    assert all(w in str(info.value) for w in words), str(info.value)


# --------------------------------------------------------------------------------------------------------------------
# Through the op (fastbert.ops, the dispatcher and the custom op)
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ops_attention_passes_the_bias(backend):
    nh, hd = 2, 32
    qkv, layout = make_packed((33, 7), nh, hd, torch.float32)
    table, scale = make_table(nh, 40), hd ** -0.5
    ctx, probs = ops.attention(qkv, layout, scale, bias=table, backend=backend)
    assert probs is None and max_error(ctx, reference64(qkv, (33, 7), scale, table)) <= 1e-5
    B, S = 3, 70
    qkv, key_mask = padded_case(B, S, nh, hd)
    mask = AttentionMask.build(key_mask, B, S, torch.float32)
    ctx, _ = ops.attention(qkv, mask, scale, bias=table, backend=backend)
    assert max_error(ctx, reference64(qkv, [S] * B, scale, table, key_mask)) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_custom_op_passes_the_bias(backend):
    """fastbert::attention with its bias argument, packed and padded, as a traced forward records it."""
    nh, hd = 2, 32
    qkv, layout = make_packed((33, 7), nh, hd, torch.float32)
    table, scale = make_table(nh, 40), hd ** -0.5
    run = dispatch.traced_ops({"attention": backend, "qkv_projection": "torch", "bias_gelu": "torch",
                               "residual_layernorm": "torch"})["attention"]
    ctx, _ = run(qkv, layout, scale, extras=Extras(bias=table))
    assert max_error(ctx, reference64(qkv, (33, 7), scale, table)) <= 1e-5
    B, S = 3, 70
    qkv, key_mask = padded_case(B, S, nh, hd)
    ctx, _ = run(qkv, AttentionMask.build(key_mask, B, S, torch.float32), scale, extras=Extras(bias=table))
    assert max_error(ctx, reference64(qkv, [S] * B, scale, table, key_mask)) <= 1e-5


def test_custom_op_schema_and_fake():
    """torch.library's own checks of fastbert::attention with a bias (schema, fake shapes, no aliasing)."""
    nh, hd = 2, 32
    qkv, layout = make_packed((9, 4), nh, hd, torch.float32)
    torch.library.opcheck(torch.ops.fastbert.attention.default,
                          (qkv, layout.cu_seqlens, 9, hd ** -0.5, None, False, "torch", -1,
                           make_table(nh, 12), None, None, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------------------------------------------------
# MPNet's table, from transformers' own bucket code
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mpnet_encoder():
    import transformers

    config = transformers.MPNetConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                      intermediate_size=37, vocab_size=50, max_position_embeddings=520)
    torch.manual_seed(0)
    encoder = transformers.models.mpnet.modeling_mpnet.MPNetEncoder(config).eval()
    with torch.no_grad():  # distinct values per bucket, so a bucket off by one shows
        encoder.relative_attention_bias.weight.copy_(torch.randn_like(encoder.relative_attention_bias.weight))
    return encoder


@pytest.mark.parametrize("S,table_len", [(1, 1), (7, 7), (100, 130), (300, 300), (300, 129)],
                         ids=lambda v: str(v))
def test_mpnet_table_equals_hf_position_bias(mpnet_encoder, S, table_len):
    """HF's [nh, S, S] position bias equals table[h, j - i + L - 1] exactly, every bucket boundary included. A table
    reaching distance 128 (MPNet's max_distance, where its buckets have stopped changing) is exact at any S."""
    with torch.no_grad():
        hf = mpnet_encoder.compute_position_bias(torch.zeros(2, S, 32))  # [B, nh, S, S]
        table = relative_bias_table(mpnet_encoder.relative_attention_bias.weight, table_len)
    assert table.shape == (4, 2 * table_len - 1) and table.dtype == torch.float32
    assert torch.equal(dense_bias64(table, S).float(), hf[0])
    assert torch.equal(twins.relative_bias(table, S, S, torch.float32), hf[0])


def test_mpnet_table_refuses_bad_arguments():
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        relative_bias_table(torch.zeros(32, 4), 0)
    with pytest.raises(ValueError, match=r"\(32,\)"):
        relative_bias_table(torch.zeros(32), 5)
