"""Gemma 3 run both ways (EmbeddingGemma) against transformers' Gemma3TextModel and sentence-transformers, random
weights, fp32.

transformers' Gemma3TextModel with use_bidirectional_attention: sandwich norms (input_layernorm and
post_attention_layernorm around attention, pre_ / post_feedforward_layernorm around the MLP), every norm Gemma's
(1 + w) RMSNorm in float32, q/k norms of that kind per head, scores scaled by 1/sqrt(query_pre_attn_scalar),
sliding and full layers from layer_types (a sliding layer sees |i - j| < sliding_window, which the config class
stores halved plus one), a rope per layer type, a tanh-GELU gated MLP, the token table times sqrt(hidden_size). The
norms' weights are drawn away from 0 (a fresh (1 + w) norm is the plain RMSNorm, which would hide the offset) and q/k
scaled up, so that a wrong window or angle cannot hide under the bar. Cases: real text tokenized by BERT's
WordPiece (no Gemma vocabulary here), right and left padded, rows longer than the window, EmbeddingGemma-300m's own
layer geometry (hidden 768, 3 query heads and 1 key/value head of 256, MLP 1,152, a 512-token window; two layers),
a checkpoint laid out as the Hub ships it, and a sentence-transformers folder as EmbeddingGemma's (mean pooling, two
Dense layers, Normalize, its query / document prompts) through fastbert.encode. Bar: max |delta| <= 1e-5 on real
tokens and on every embedding component.
"""
import numpy as np
import pytest
import torch
import transformers
from helpers import (
    GEMMA_PROMPTS,
    _family_tokenizer,
    error_on_real_tokens,
    gemma3_config,
    gemma3_model,
    gemma3_st_folder,
    has_decoder_embedders,
    optional,
    ragged_rows,
    real_texts,
)

import fastbert

pytestmark = pytest.mark.skipif(not has_decoder_embedders(), reason="fastbert runs this family from transformers 5 on")


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return _family_tokenizer("gemma3_text", minilm_path)


@pytest.fixture(scope="module")
def texts():
    return real_texts(6)


def batch(tokenizer, texts, left):
    tokenizer.padding_side = "left" if left else "right"
    enc = tokenizer(texts, padding=True, truncation=True, max_length=200, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_real_text_matches_transformers(tokenizer, texts, impl, left):
    hf = gemma3_model(attn_implementation=impl)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = batch(tokenizer, texts, left)
    assert mask.sum(1).max() > 2 * hf.config.sliding_window  # rows past the window
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_hidden_states=True)
        got = fb(ids, attention_mask=mask, output_hidden_states=True)
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        assert error_on_real_tokens(g, w, mask) <= 1e-5
    assert error_on_real_tokens(got.last_hidden_state, want.last_hidden_state, mask) <= 1e-5
    assert got.last_hidden_state[~mask.bool()].abs().max() == 0


def test_the_window_is_transformers_own():
    """Layer 0's window is |i - j| < sliding_window as the config class stores it (16 given: 9 stored, w = 8); one
    wider or narrower moves the output far past the bar."""
    hf = gemma3_model()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    assert hf.config.sliding_window == 9 and [layer.window for layer in fb.layers] == [8, 8, None]
    ids, mask = ragged_rows([40, 25], low=4)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state
        assert error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state, want, mask) <= 1e-5
        for wrong in (7, 9):
            for layer in fb.layers[:2]:
                layer.window = wrong
            assert error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state, want, mask) > 1e-3


def test_model_built_from_the_config_loads_the_state_dict(tokenizer, texts):
    """fastbert's own modules (its (1 + w) RMSNorm, its scaled token table), not HF's: the same numbers."""
    hf = gemma3_model()
    fb = fastbert.AutoModel.from_config(hf.config, kernels="torch")
    assert type(fb.embed_tokens).__name__ == "ScaledEmbedding" and type(fb.norm).__name__ == "OffsetRMSNorm"
    fb.load_state_dict(hf.state_dict())
    fb.eval()
    ids, mask = batch(tokenizer, texts, left=False)
    with torch.no_grad():
        assert error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state,
                                    hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def test_embeddinggemma_300m_layer_geometry():
    """EmbeddingGemma-300m's layer: hidden 768, 3 query heads and 1 key/value head of 256 (the attention kernel has
    no 256-wide head: "auto" runs the twin), MLP 1,152, query_pre_attn_scalar 256, a 512-token window (257 stored),
    thetas 10,000 / 1,000,000; one sliding and one full layer, a small vocabulary, rows of 600 tokens past the
    window."""
    hf = gemma3_model(qk_gain=1.0, hidden=768, heads=3, kv_heads=1, head_dim=256, layers=2, intermediate=1152,
                      vocab=1000, window=512,
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    assert fb.layers[0].window == 256 and fb.layers[0].self_attn.q_proj.weight.shape == (768, 768)
    ids, mask = ragged_rows([600, 300, 17], low=4)
    ids = ids % 1000
    with torch.no_grad():
        assert error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state,
                                    hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def test_refusals():
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        fastbert.BertModel(gemma3_config(use_bidirectional_attention=False))
    with pytest.raises(NotImplementedError, match="attn_logit_softcapping"):
        fastbert.BertModel(gemma3_config(attn_logit_softcapping=50.0))


@pytest.fixture(scope="module")
def gemma_st(tmp_path_factory, tokenizer):
    return gemma3_st_folder(tmp_path_factory.mktemp("gemma"), tokenizer)


def test_hub_checkpoint_loads(gemma_st, tokenizer, texts):
    from safetensors import safe_open
    hf, root = gemma_st
    with safe_open(str(root / "hf" / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" in f.keys() and "layers.0.post_feedforward_layernorm.weight" in f.keys()
    fb = fastbert.AutoModel.from_pretrained(str(root / "hf"), kernels="torch")
    assert type(fb).__name__ == "Gemma3TextModel"
    stock = transformers.AutoModel.from_pretrained(str(root / "hf"), attn_implementation="sdpa").eval()
    ids, mask = batch(tokenizer, texts, left=False)
    with torch.no_grad():
        assert error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state,
                                    stock(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


@pytest.mark.parametrize("how", [{}, {"prompt_name": "query"}, {"prompt_name": "document"}],
                         ids=["plain", "query", "document"])
def test_encode_equals_sentence_transformers(gemma_st, texts, how):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    _, root = gemma_st
    stock = st.SentenceTransformer(str(root / "st"), device="cpu")
    want = stock.encode(texts, batch_size=4, **how)
    encoder = fastbert.SentenceEncoder.from_pretrained(str(root / "st"), device="cpu", kernels="torch")
    got = encoder.encode(texts, **how)
    assert got.shape == want.shape == (len(texts), 64) and encoder.dimension == 64
    assert np.abs(got - want).max() <= 1e-5
    if how:
        assert np.abs(got - stock.encode(texts, batch_size=4)).max() > 1e-3  # the prompt reached the model
    # the server's path: one packed batch, pooled, the Dense layers, then Normalize (the server's)
    ids = [encoder.tokenizer(t, truncation=True, max_length=256)["input_ids"] for t in texts]
    if how:
        prompt = GEMMA_PROMPTS[how["prompt_name"]]
        ids = [encoder.tokenizer(prompt + t, truncation=True, max_length=256)["input_ids"] for t in texts]
    packed = torch.nn.functional.normalize(encoder.embed_tokenized(ids), dim=-1).numpy()
    assert np.abs(packed - want).max() <= 1e-5
