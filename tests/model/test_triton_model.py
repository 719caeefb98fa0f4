"""The whole model with its ops on Triton (the interpreter on CPU, the compiled kernels on CUDA) against HF."""
import pytest
import torch
import transformers
from helpers import DEVICE, assert_close_on, assert_pooler_matches, hf_dtype, make_inputs, random_hf_bert

import fastbert
from fastbert import ops, units
from fastbert.numerics import FP32_TOL, error_bound

pytestmark = pytest.mark.filterwarnings("error::UserWarning")  # "auto" must not fall back silently or noisily here


@pytest.fixture(scope="module", params=[True, False], ids=["padding_free", "padded"])
def tiny(request):
    hf = random_hf_bert(hidden=64, heads=2, layers=2, intermediate=100, act="gelu", max_pos=40).to(DEVICE)
    return hf, fastbert.BertModel.from_hf(hf, kernels="triton", padding_free=request.param)


def _inputs(padding, S=11):
    return [t.to(DEVICE) for t in make_inputs(padding, S=S)]


@pytest.mark.parametrize("padding", ["none", "right", "left", "fully_padded_row"])
def test_all_ops_on_triton_match_hf(tiny, padding):
    hf, fb = tiny
    hf.config._attn_implementation = "eager"
    ids, tt, mask = _inputs(padding)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True)
        out = fb(ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True)
    for h_out, h_ref in zip(out.hidden_states, ref.hidden_states):
        assert_close_on(h_out, h_ref, mask, fb.padding_free)
    if fb.padding_free:  # the varlen kernel: real tokens only
        assert_pooler_matches(out.pooler_output, hf, ids, mask, tt)
    else:  # the masked kernel on padded rows
        live = mask.bool().any(1)
        assert (out.pooler_output - ref.pooler_output)[live].abs().max() <= 1e-5
        if padding == "fully_padded_row":  # HF eager's uniform attention, reproduced by the kernel
            assert (out.last_hidden_state[2] - ref.last_hidden_state[2]).abs().max() <= FP32_TOL


@pytest.mark.parametrize("op", fastbert.OPS)
def test_each_op_alone_on_triton(tiny, op):
    hf, fb = tiny
    fb = fastbert.BertModel.from_hf(hf, kernels="torch", padding_free=fb.padding_free).set_kernels(**{op: "triton"})
    ids, tt, mask = _inputs("right", S=7)
    with torch.no_grad():
        ref = fastbert.BertModel.from_hf(hf, kernels="torch", padding_free=fb.padding_free)(
            ids, attention_mask=mask, token_type_ids=tt)
        out = fb(ids, attention_mask=mask, token_type_ids=tt)
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask, fb.padding_free)


# The model reaches each op's kernel through its unchecked launcher (it validates once per forward).
LAUNCHERS = dict.fromkeys(fastbert.OPS, "launch")


def test_auto_picks_triton_here(tiny, monkeypatch):
    """On CUDA (or the interpreter) "auto" runs the kernels: prove it by counting launcher calls."""
    hf, fb = tiny
    calls = []
    for op, name in LAUNCHERS.items():
        module = units.UNITS[op].kernels()
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _op=op, **k: calls.append(_op) or _real(*a, **k))
    fb = fastbert.BertModel.from_hf(hf, kernels="auto", padding_free=fb.padding_free)
    ids, tt, mask = _inputs("right", S=5)
    with torch.no_grad():
        fb(ids, attention_mask=mask)
    assert sorted(set(calls)) == sorted(fastbert.OPS)
    assert calls.count("residual_layernorm") == 2 * hf.config.num_hidden_layers


def test_bert_attention_block_matches_hf_module(tiny):
    """qkv_projection + attention + residual_layernorm on Triton == HF's BertAttention (self + output) module."""
    hf, fb = tiny
    hf.config._attn_implementation = "eager"
    hf_block = hf.encoder.layer[0].attention
    layer = fb.encoder.layer[0]
    B, S, H = 3, 13, 64
    x = torch.randn(B, S, H, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(3))
    keep = torch.ones(B, S, dtype=torch.long, device=DEVICE)
    keep[1, 9:] = 0
    keep[2, :4] = 0
    mask = ops.AttentionMask.build(keep, B, S, torch.float32)
    with torch.no_grad():
        ref = hf_block(x, attention_mask=mask.additive)[0]
        qkv = ops.qkv_projection(x.view(-1, H), layer.attention.self.qkv_weight, layer.attention.self.qkv_bias, 2,
                                 backend="triton")
        ctx, _ = ops.attention(qkv, mask, layer.scale, backend="triton")
        o = layer.attention.output
        out = ops.residual_layernorm(ctx, o.dense.weight, o.dense.bias, x.view(-1, H), o.LayerNorm.weight,
                                     o.LayerNorm.bias, hf.config.layer_norm_eps, backend="triton")
    assert_close_on(out.view(B, S, H), ref, keep, padding_free=False)  # padded rows: HF's values where padded


def test_fp16_error_at_most_twice_hf():
    hf = random_hf_bert(hidden=64, heads=2, layers=2, intermediate=100, max_pos=40).to(DEVICE)
    ids, tt, mask = _inputs("right", S=13)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        hf16 = random_hf_bert(hidden=64, heads=2, layers=2, intermediate=100, max_pos=40).to(DEVICE).half()
        hf_err = hf16(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state.float() - ref
        fb16 = fastbert.BertModel.from_hf(hf16, kernels="triton")
        fb_err = fb16(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state.float() - ref
    real = mask.bool()
    assert torch.isfinite(fb_err).all()
    assert fb_err[real].abs().max() <= error_bound(torch.float16, hf_err[real].abs().max().item())


def test_minilm_all_triton_short_ragged_batch(minilm_path, tokenizer):
    hf = transformers.BertModel.from_pretrained(minilm_path, attn_implementation="sdpa",
                                                **hf_dtype(torch.float32)).eval().to(DEVICE)
    fb = fastbert.BertModel.from_pretrained(minilm_path, kernels="triton", device=DEVICE, dtype=torch.float32)
    enc = tokenizer(["A man is eating food.", "Hi", "The weather is lovely today, let's go for a walk."],
                    padding=True, return_tensors="pt").to(DEVICE)
    with torch.no_grad():
        ref, out = hf(**enc), fb(**enc)
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, enc["attention_mask"], fb.padding_free)
    assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5
