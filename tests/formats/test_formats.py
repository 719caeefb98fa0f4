"""The number formats of the GEMMs (fastbert/formats.py): each format's linear against a float64 reference, and
every family on random weights in bf16 and int8 against its own fp32 forward, held to the format's bar
(docs/formats.md says why each bar is where it is). CPU, the PyTorch path."""
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    ARCHS,
    _family_tokenizer,
    arch_inputs,
    gemma3_model,
    has_decoder_embedders,
    qwen3_model,
    random_arch_model,
    real_texts,
    type_kwargs,
)

import fastbert
from fastbert import formats

# Per-token relative error of the last hidden state against the same model's fp32 GEMMs, worst real token
# (docs/formats.md, "Bars"): bf16 rounds each GEMM operand to 8 significant bits (relative 2^-9 per element);
# int8 quantizes weights per channel and activations per token (a step of 1/127 of the row's largest |value|,
# 1/63 for weights on CPUs without VNNI).
BARS = {"bf16": 0.01, "int8": 0.08}
# Gemma 3 random weights amplify a GEMM's rounding ~3x more than the encoders (its whole-bf16 model: 0.032)
DECODER_INT8_BAR = 0.1


def relative_error(got, want):
    return float(((got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1)).max())


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("shape", [(1, 64, 96), (37, 384, 1536), (300, 1536, 384), (5, 33, 7)])
def test_linear_against_float64(fmt, shape):
    """Each format's GEMM on ragged shapes (rows below a SIMD width, odd K and N) with a bias, against float64: the
    error of one rounding of the operands, well below what a wrong scale or a saturating dot product gives."""
    T, K, N = shape
    g = torch.Generator().manual_seed(T + K)
    x = torch.randn(T, K, generator=g) * torch.linspace(0.1, 3.0, K)  # uneven channels, as hidden states have
    x[0, 0] = 12.0  # an outlier: the per-token scale must follow it
    w, b = torch.randn(N, K, generator=g) * K ** -0.5, torch.randn(N, generator=g)
    want = F.linear(x.double(), w.double(), b.double())
    got = formats.format_of(fmt).linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (T, N)
    # per output row: |error| / (|x| |w| summed magnitude scale), bounded by the operands' rounding steps
    scale = (x.double().abs() @ w.double().abs().t())
    err = float(((got.double() - want).abs() / scale).max())
    bound = {"bf16": 2 * 2 ** -8, "int8": 2 * (1 / 127 + 1 / formats.weight_levels(x.device))}[fmt]
    assert err <= bound, (fmt, shape, err, bound)
    assert err >= bound / 1000, "the format changed nothing: its GEMM did not run"


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_hidden_against_float64(fmt):
    """`hidden`, the GEMM an activation alone reads before the next GEMM (bias_gelu): bf16 keeps it in bf16 where
    the CPU has bf16 dot products (the bias added in the GEMM, one more rounding of the result), int8 in fp32 as
    `linear`. Both within their bound against float64, and the bf16 form feeds the next GEMM unconverted."""
    T, K, N = 300, 384, 1536
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, K, generator=g) * torch.linspace(0.1, 3.0, K)
    w, b = torch.randn(N, K, generator=g) * K ** -0.5, torch.randn(N, generator=g)
    fmt_ = formats.format_of(fmt)
    got = fmt_.hidden(x, w, b)
    native = fmt == "bf16" and fmt_.native(x.device)
    assert got.dtype == (torch.bfloat16 if native else torch.float32) and got.shape == (T, N)
    want = F.linear(x.double(), w.double(), b.double())
    scale = x.double().abs() @ w.double().abs().t() + b.double().abs()
    err = float(((got.double() - want).abs() / scale).max())
    bound = {"bf16": 3 * 2 ** -8, "int8": 2 * (1 / 127 + 1 / formats.weight_levels(x.device))}[fmt]
    assert bound / 1000 <= err <= bound, (fmt, err, bound)
    if fmt == "int8":
        assert torch.equal(got, fmt_.linear(x, w, b))
    # the activation in place and the next GEMM of the format, as bias_gelu and residual_layernorm call them
    from fastbert.units import bias_gelu
    h = bias_gelu.twin(x, w, b, "gelu", fmt=fmt_)
    assert h.dtype == got.dtype
    want_h = F.gelu(want)
    assert float((h.double() - want_h).abs().max() / want_h.abs().max()) <= 4 * bound
    out = fmt_.linear(h, torch.randn(K, N, generator=g) * N ** -0.5, None)
    assert out.dtype == torch.float32 and out.shape == (T, K)


@pytest.mark.parametrize("offset", [0, formats.ZERO_POINT])
def test_token_quantization_paths_agree(offset, monkeypatch):
    """quantize_tokens in blocks of a few rows (the last one short) gives the integers and scales of one block over
    the whole tensor, as int8 and as the u8 form (q + 128) oneDNN takes; each is round(x / scale) computed in float64
    here. Skipped channels are out of the scale and 0 in q."""
    x = torch.randn(50, 70) * 3
    x[3] = 0.0  # an all-zero token: scale clamped, q = 0
    x[:, 11] *= 40  # an outlier channel
    whole = formats.quantize_tokens(x, offset)
    monkeypatch.setattr(formats, "TOKEN_BLOCK_ELEMENTS", 70 * 8)  # 8 rows a block: 6 blocks and one of 2
    blocked = formats.quantize_tokens(x, offset)
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    for skip in (None, [11]):
        q, scale = formats.quantize_tokens(x, offset, None if skip is None else torch.tensor(skip))
        q = q.long() - offset
        inl = x.double().clone()
        if skip:
            inl[:, skip] = 0.0
        want_scale = inl.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
        assert torch.allclose(scale.double(), want_scale, rtol=1e-6, atol=0)
        want = torch.round(inl / want_scale)
        assert (q - want).abs().max() <= 1  # a tie may round either way between float32 and float64
        assert q.abs().max() == 127 and not q[3].any()
        assert not skip or not q[:, skip].any()
        assert (formats.quantize_tokens(x, offset)[0].dtype == (torch.uint8 if offset else torch.int8))


def _int8_reference(x, w, b, outliers, levels):
    """The int8 format's arithmetic in float64: the outlier channels' columns left out of the int8 product (weights
    and activations), each side quantized symmetrically (weights per row, tokens per row), plus the outlier
    channels' exact product."""
    x, w = x.double(), w.double()
    inl_x, inl_w = x.clone(), w.clone()
    inl_x[:, outliers], inl_w[:, outliers] = 0.0, 0.0
    sx = inl_x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    sw = inl_w.abs().amax(1, keepdim=True).clamp_min(1e-12) / levels
    qx, qw = torch.round(inl_x / sx), torch.round(inl_w / sw)
    return (qx @ qw.T) * sx * sw.T + b.double() + x[:, outliers] @ w[:, outliers].T


def test_outlier_channels_leave_the_int8_product():
    """Activations with two channels 40x the rest (as [CLS] and LayerNorm's large-gain dimensions make them): with
    those channels calibrated as outliers the format computes _int8_reference's numbers, and its error against the
    exact product is several times smaller than per-token int8's without them."""
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(64, 192, generator=g), torch.randn(96, 192, generator=g) * 0.1, torch.randn(96, generator=g)
    x[:, [17, 150]] *= 40
    exact = x.double() @ w.double().T + b.double()
    plain = formats.Int8()
    fmt = formats.Int8()
    fmt.set_outliers({w: [17, 150]})
    with torch.no_grad():
        got, without = fmt.linear(x, w, b), plain.linear(x, w, b)
    want = _int8_reference(x, w, b, [17, 150], formats.weight_levels(x.device))
    assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()
    err, err_plain = (got.double() - exact).abs().max(), (without.double() - exact).abs().max()
    assert err * 5 < err_plain, (err, err_plain)


def test_calibration_finds_the_largest_channels():
    """ChannelRecorder runs fp32 (the GEMM's own numbers) and keeps, per weight, the outlier_count(K) input
    channels with the largest |x| over every call; 1 in 96 channels, rounded up."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 384, generator=g)
    recorder = formats.ChannelRecorder()
    big = [5, 77, 200, 301]
    for i, col in enumerate(big):
        x = torch.randn(8, 384, generator=g)
        x[i, col] = 100.0 + i  # each channel large in one call only
        assert torch.equal(recorder.linear(x, w, None), F.linear(x, w))
    assert sorted(recorder.outliers()[w].tolist()) == big
    assert [formats.outlier_count(k) for k in (96, 384, 768, 1536, 100)] == [1, 4, 8, 16, 2]


def test_int_mm_path_matches_onednn():
    """The CUDA path's arithmetic (torch._int_mm over the same integers, scaled per token and channel), run here on
    CPU, equals the oneDNN path's up to float rounding: the two devices compute one format."""
    x, w, b = torch.randn(40, 64), torch.randn(48, 64) * 0.1, torch.randn(48)
    q, s = formats.quantize_rows(w, formats.weight_levels(x.device))
    qx, sx = formats.quantize_tokens(x)
    int_mm = torch._int_mm(qx, q.t()).float() * sx * s.view(1, -1) + b
    onednn = formats.Int8().linear(x, w, b)
    assert (int_mm - onednn).abs().max() <= 1e-4 * int_mm.abs().max()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_every_family_in_each_format(arch, fmt):
    """Every family's encoder (random weights, real HF shapes, padded batches) in the format against its own fp32
    GEMMs: within the format's bar and not equal to fp32 (the format ran); set_format("fp32") gives fp32's bits
    back; the state dict is untouched."""
    hf = random_arch_model(arch)
    fb = fastbert.BertModel.from_hf(hf)
    ids, tt, mask = arch_inputs(hf, "right")
    state = {k: v.clone() for k, v in fb.state_dict().items()}
    with torch.inference_mode():
        want = fb(ids, attention_mask=mask, **type_kwargs(tt)).last_hidden_state
        fb.set_format(fmt)
        got = fb(ids, attention_mask=mask, **type_kwargs(tt)).last_hidden_state
        fb.set_format("fp32")
        back = fb(ids, attention_mask=mask, **type_kwargs(tt)).last_hidden_state
    real = mask.bool()
    err = relative_error(got[real], want[real])
    assert 1e-6 < err <= BARS[fmt], (arch, fmt, err)
    assert torch.equal(back, want)
    assert all(torch.equal(v, state[k]) for k, v in fb.state_dict().items())


class WeightsSeen(formats.BF16):
    """bf16, recording every matrix its GEMMs prepare (a fused group's weight is one matrix)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def prepared(self, weight):
        if weight.dim() == 2:
            self.seen.add(id(weight))
        return super().prepared(weight)


@pytest.mark.parametrize("family", [*ARCHS, "qwen3", "gemma3_text"])
def test_every_layer_linear_runs_in_the_format(family):
    """A layer's four GEMMs (QKV, attention output, the FFN's first and second) all run in the format, the output
    GEMMs that pre-norm layers compute outside the fused ops included: the format prepares 4 matrices a layer."""
    if family in ("qwen3", "gemma3_text"):
        if not has_decoder_embedders():
            pytest.skip("fastbert runs these families from transformers 5 on")
        hf = qwen3_model() if family == "qwen3" else gemma3_model()
        ids = torch.randint(5, 100, (2, 9))
        mask, kwargs = torch.ones_like(ids), {}
    else:
        hf = random_arch_model(family)
        ids, tt, mask = arch_inputs(hf, "right")
        kwargs = type_kwargs(tt)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    fmt = WeightsSeen()
    with torch.inference_mode():
        fb.set_format(fmt)
        fb(ids, attention_mask=mask, **kwargs)
    assert len(fmt.seen) == 4 * len(fb.layers), (family, len(fmt.seen), len(fb.layers))


@pytest.mark.skipif(not has_decoder_embedders(), reason="fastbert runs these families from transformers 5 on")
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_decoder_embedders_in_each_format(family, fmt, minilm_path):
    """Qwen3 (causal, q/k norms, grouped k/v, SwiGLU) and Gemma 3 (sandwich norms, sliding layers, tanh-GELU gated
    MLP) on real text, left padded, in the format against their own fp32. bf16 is held to what transformers' own
    bf16 model loses on the same tokens (its worst token: 0.032 for this Gemma, whose q/k gain and four norms a layer
    amplify rounding, 0.0085 for this Qwen3); int8 to DECODER_INT8_BAR."""
    hf = qwen3_model() if family == "qwen3" else gemma3_model()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    tokenizer = _family_tokenizer(family, minilm_path)
    tokenizer.padding_side = "left"
    enc = tokenizer(real_texts(6), padding=True, truncation=True, max_length=128, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    real = mask.bool()
    with torch.inference_mode():
        want = fb(ids, attention_mask=mask).last_hidden_state
        fb.set_format(fmt)
        got = fb(ids, attention_mask=mask).last_hidden_state
        bar = DECODER_INT8_BAR
        if fmt == "bf16":
            whole = hf.to(torch.bfloat16)(ids, attention_mask=mask).last_hidden_state
            bar = relative_error(whole[real], want[real])
    err = relative_error(got[real], want[real])
    assert 1e-6 < err <= bar, (family, fmt, err, bar)


def test_formats_refuse_what_they_cannot_do():
    hf = random_arch_model("bert")
    fb = fastbert.BertModel.from_hf(hf).set_format("int8")
    ids, tt, mask = arch_inputs(hf, "right")
    with pytest.raises(RuntimeError, match="for inference"):
        fb(ids, attention_mask=mask, token_type_ids=tt)  # autograd on: the prepared weights have no gradient
    with pytest.raises(ValueError, match="not a number format"):
        fb.set_format("int4")
    with pytest.raises(ValueError, match="float32 model"):
        fastbert.BertModel.from_hf(random_arch_model("bert").to(torch.bfloat16)).set_format("int8")
    with pytest.raises(RuntimeError, match="backend 'triton'.*int8"):
        fb.set_kernels(qkv_projection="triton") if fastbert.dispatch.triton_import_error() is None else None
        fb.__dict__["_kernels"]["qkv_projection"] = "triton"
        fb.resolve_ops()
