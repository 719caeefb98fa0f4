"""fastbert's PyTorch path against transformers' own BertModel (eager and sdpa), fp32 and bf16, on CPU.

The bar (fastbert/numerics.py): fp32 max |fastbert - HF| <= 1e-5 on every real token of last_hidden_state and of
every hidden state, and on pooler_output; bf16 error against an fp32 reference at most 2x HF's own bf16 error.
Padded positions: padding-free execution (the default) returns exactly 0 there; padding_free=False returns HF's
values (within 1e-4 on rows that have a real token). The pooler reads each row's first real token: HF's position 0
whenever that is real (right padding), the [CLS] of the row run alone otherwise (left padding).
"""
import pytest
import torch
from helpers import assert_close_on, assert_pooler_matches, hf_dtype, make_inputs, random_hf_bert

import fastbert
from fastbert.numerics import FP32_TOL, error_bound

CONFIGS = {  # hidden, heads, layers, intermediate, act  (head dims 16, 32, 64; intermediates not multiples of 64)
    "h32-nh1-L1-gelu": (32, 1, 1, 37, "gelu"),
    "h64-nh4-L2-gelu_new": (64, 4, 2, 100, "gelu_new"),
    "h128-nh8-L2-tanh": (128, 8, 2, 200, "gelu_pytorch_tanh"),
    "h96-nh3-L4-relu": (96, 3, 4, 130, "relu"),
    "h384-nh12-L2-gelu": (384, 12, 2, 1000, "gelu"),
    "h768-nh12-L1-gelu": (768, 12, 1, 3000, "gelu"),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def hf_model(request):
    hidden, heads, layers, inter, act = CONFIGS[request.param]
    return random_hf_bert(hidden, heads, layers, inter, act)


@pytest.fixture(scope="module", params=[True, False], ids=["padding_free", "padded"])
def pair(request, hf_model):
    return hf_model, fastbert.BertModel.from_hf(hf_model, kernels="torch", padding_free=request.param)


@pytest.mark.parametrize("padding", ["none", "right", "left", "fully_padded_row"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_random_configs_match_hf(pair, padding, attn):
    hf, fb = pair
    hf.config._attn_implementation = attn
    ids, tt, mask = make_inputs(padding)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True)
        out = fb(ids, attention_mask=mask, token_type_ids=tt, output_hidden_states=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == hf.config.num_hidden_layers + 1
    for h_out, h_ref in zip(out.hidden_states, ref.hidden_states):
        assert_close_on(h_out, h_ref, mask, fb.padding_free)
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask, fb.padding_free)
    if fb.padding_free:
        assert_pooler_matches(out.pooler_output, hf, ids, mask, tt)
    else:  # padded rows: HF's own pooler, which reads position 0 whatever it holds
        live = mask.bool().any(1)
        assert (out.pooler_output - ref.pooler_output)[live].abs().max() <= 1e-5


def test_fully_padded_row_is_finite_and_isolated(pair):
    """A row with no real token stays finite and leaves the other rows as they are without it. Padding-free: its
    outputs are zeros (nothing of it is computed). Padded: HF eager's answer, uniform attention over all its keys."""
    hf, fb = pair
    ids, tt, mask = make_inputs("fully_padded_row")
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        out = fb(ids, attention_mask=mask, token_type_ids=tt)
        alone = fb(ids[:2], attention_mask=mask[:2], token_type_ids=tt[:2])
        eager = hf(ids, attention_mask=mask, token_type_ids=tt)
    assert torch.isfinite(out.last_hidden_state).all() and torch.isfinite(out.pooler_output).all()
    assert (out.last_hidden_state[:2] - alone.last_hidden_state).abs().max() <= 1e-6
    if fb.padding_free:
        assert (out.last_hidden_state[2] == 0).all()
        assert (out.pooler_output[2] - torch.tanh(hf.pooler.dense.bias)).abs().max() <= 1e-6
    else:
        assert (out.last_hidden_state[2] - eager.last_hidden_state[2]).abs().max() <= FP32_TOL


@pytest.mark.parametrize("S", [1, 64])  # 64 = max_position_embeddings of the random configs
def test_seq_len_extremes(pair, S):
    hf, fb = pair
    ids = torch.randint(1, 99, (2, S), generator=torch.Generator().manual_seed(S))
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1, S // 2 + 1:] = 0
    with torch.no_grad():
        ref, out = hf(ids, attention_mask=mask), fb(ids, attention_mask=mask)
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask, fb.padding_free)
    assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5


def test_position_ids_inputs_embeds_and_attentions(pair):
    hf, fb = pair
    hf.config._attn_implementation = "eager"  # the path that returns attention probabilities
    ids, tt, mask = make_inputs("right")
    pos = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]).expand(3, -1).contiguous()
    embeds = hf.embeddings.word_embeddings(ids).detach()
    with torch.no_grad():
        ref = hf(inputs_embeds=embeds, attention_mask=mask, token_type_ids=tt, position_ids=pos,
                 output_attentions=True)
        out = fb(inputs_embeds=embeds, attention_mask=mask, token_type_ids=tt, position_ids=pos,
                 output_attentions=True)
        ref_ids = hf(ids, attention_mask=mask, position_ids=pos[:1])  # a [1, S] position_ids broadcasts
        out_ids = fb(ids, attention_mask=mask, position_ids=pos[:1])
    # output_attentions runs padded rows; a padding-free model still returns zeros at padded positions
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask, fb.padding_free)
    assert_close_on(out_ids.last_hidden_state, ref_ids.last_hidden_state, mask, fb.padding_free)
    assert len(out.attentions) == len(ref.attentions)
    for a, r in zip(out.attentions, ref.attentions):
        assert a.shape == r.shape
        assert (a - r).abs().max() <= 1e-6


def test_return_dict_false_orders_like_hf(pair):
    hf, fb = pair
    ids, tt, mask = make_inputs("right")
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True, return_dict=False)
        out = fb(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(ref)
    assert_close_on(out[0], ref[0], mask, fb.padding_free)
    assert (out[1] - ref[1]).abs().max() <= 1e-5  # make_inputs("right"): every row's position 0 is real
    for o, r in zip(out[2:], ref[2:]):
        assert type(o) is type(r) and len(o) == len(r)
    for o, r in zip(out[2], ref[2]):  # hidden states
        assert_close_on(o, r, mask, fb.padding_free)


def test_bf16_error_at_most_twice_hf():
    hf = random_hf_bert(384, 12, 2, 1000, "gelu")
    ids, tt, mask = make_inputs("right", S=33)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        hf16 = random_hf_bert(384, 12, 2, 1000, "gelu").to(torch.bfloat16)
        hf_err = (hf16(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state.float() - ref)
        fb = fastbert.BertModel.from_hf(hf16, kernels="torch")
        fb_err = (fb(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state.float() - ref)
    real = mask.bool()
    hf_max, fb_max = hf_err[real].abs().max(), fb_err[real].abs().max()
    assert torch.isfinite(fb_err).all()
    assert 0 < hf_max and fb_max <= error_bound(torch.bfloat16, hf_max.item()), (fb_max, hf_max)


def test_empty_batch_returns_empty_outputs(pair):
    """B = 0 gives empty outputs of the right shapes (transformers 5.24's own BertModel raises on this input)."""
    hf, fb = pair
    ids = torch.zeros(0, 7, dtype=torch.long)
    H = hf.config.hidden_size
    with torch.no_grad():
        out = fb(ids, attention_mask=torch.ones(0, 7), output_hidden_states=True)
    assert out.last_hidden_state.shape == (0, 7, H) and out.pooler_output.shape == (0, H)
    assert all(h.shape == (0, 7, H) for h in out.hidden_states)


# ---- the real model: all-MiniLM-L6-v2, its tokenizer, real sentences -------------------------------------------------
SENTENCES = ["A man is eating food.", "The new movie is awesome, I would watch it again tomorrow night.",
             "Hi", "Two dogs are playing in the snow while children build a snowman in the garden next door."]


@pytest.fixture(scope="module", params=[True, False], ids=["padding_free", "padded"])
def minilm(minilm_path, request):
    import transformers
    f32 = torch.float32  # explicit: a packed copy of the model (bench/pack_minilm.py) stores fp16
    hf = {a: transformers.BertModel.from_pretrained(minilm_path, attn_implementation=a, **hf_dtype(f32)).eval()
          for a in ("eager", "sdpa")}
    return hf, fastbert.BertModel.from_pretrained(minilm_path, kernels="torch", dtype=f32, padding_free=request.param)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", ["one_sentence", "ragged_right", "ragged_left", "pairs"])
def test_minilm_matches_hf(minilm, tokenizer, attn, case):
    hf, fb = minilm
    tokenizer.padding_side = "left" if case == "ragged_left" else "right"
    try:
        if case == "one_sentence":
            enc = tokenizer(SENTENCES[1:2], return_tensors="pt")
        elif case == "pairs":
            enc = tokenizer(SENTENCES[:2], SENTENCES[2:], padding=True, return_tensors="pt")
            assert enc["token_type_ids"].any()
        else:
            enc = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = "right"
    with torch.no_grad():
        ref = hf[attn](**enc, output_hidden_states=True)
        out = fb(**enc, output_hidden_states=True)
    for h_out, h_ref in zip(out.hidden_states, ref.hidden_states):
        assert_close_on(h_out, h_ref, enc["attention_mask"], fb.padding_free)
    if fb.padding_free:
        assert_pooler_matches(out.pooler_output, hf[attn], enc["input_ids"], enc["attention_mask"],
                              enc["token_type_ids"])
    else:
        assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5


def test_minilm_max_length_and_fully_padded_row(minilm, tokenizer):
    hf, fb = minilm
    S = fb.config.max_position_embeddings
    ids = torch.randint(1000, 30000, (2, S), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, S, dtype=torch.long)
    mask[1] = 0
    with torch.no_grad():
        ref = hf["eager"](ids, attention_mask=mask).last_hidden_state
        out = fb(ids, attention_mask=mask).last_hidden_state
    assert_close_on(out, ref, mask, fb.padding_free)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() if fb.padding_free else (out[1] - ref[1]).abs().max() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("return_probs", [False, True])
def test_twin_fully_padded_row_is_uniform_in_every_dtype(dtype, return_probs):
    """fp16's finfo.min (-65504) does not swamp large scores once sdpa adds it in fp32: the twin states the
    uniform answer outright rather than relying on the additive mask."""
    from fastbert import ops
    B, S, nh, hd = 2, 9, 2, 16  # the padded-rows twin (padding_free=False, output_attentions, custom masks)
    qkv = (torch.randn(B * S, 3, nh, hd, generator=torch.Generator().manual_seed(0)) * 8).to(dtype)
    keep = torch.ones(B, S, dtype=torch.long)
    keep[1] = 0
    mask = ops.AttentionMask.build(keep, B, S, dtype)
    ctx, probs = ops.attention_torch(qkv, mask, hd ** -0.5, return_probs=return_probs)
    v = qkv.view(B, S, 3, nh, hd)[1, :, 2].float()                           # [S, nh, hd]
    want = v.mean(0).reshape(1, nh * hd).expand(S, -1)
    assert (ctx.view(B, S, -1)[1].float() - want).abs().max() <= (1e-6 if dtype == torch.float32 else 0.05)
    if return_probs:
        assert torch.allclose(probs[1].float(), torch.full((nh, S, S), 1 / S), atol=1e-3)
