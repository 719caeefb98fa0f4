"""Qwen3 (Qwen3-Embedding) against transformers' Qwen3Model and sentence-transformers, random weights, fp32.

transformers' Qwen3Model is a causal decoder: RMSNorm pre-norm, q_proj/k_proj/v_proj with grouped key/value heads
of head_dim (which need not be hidden / heads), an RMSNorm over each head's q and k before rotary, SwiGLU, a final
norm. Its positions count padding (arange over the row), so a left-padded text is rotated from another origin than
fastbert's packed text: rotary depends on j - i only, so the two agree to rounding. Cases: real text tokenized by
BERT's WordPiece (no Qwen BPE vocabulary is on this machine; the model sees token ids either way), right and left
padded batches, the kernels through Triton's interpreter, Qwen3-Embedding-0.6B's own head geometry (16 query heads
and 8 key/value heads of 128 over hidden 1,024, SwiGLU 3,072; one layer, a small vocabulary), a checkpoint laid out as
the Hub ships it (no "model." prefix, architectures Qwen3ForCausalLM), and a sentence-transformers folder as
Qwen3-Embedding's (last-token pooling, Normalize, the "query" instruction prompt, left padding) through
fastbert.encode. Bar: max |delta| <= 1e-5 on real tokens and on every embedding component.
"""
import numpy as np
import pytest
import torch
import transformers
from helpers import (
    _family_tokenizer,
    error_on_real_tokens,
    has_decoder_embedders,
    optional,
    qwen3_config,
    qwen3_model,
    qwen3_st_folder,
    real_texts,
)

import fastbert

pytestmark = pytest.mark.skipif(not has_decoder_embedders(), reason="fastbert runs this family from transformers 5 on")


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return _family_tokenizer("qwen3", minilm_path)


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
    hf = qwen3_model(attn_implementation=impl)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = batch(tokenizer, texts, left)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_hidden_states=True)
        got = fb(ids, attention_mask=mask, output_hidden_states=True)
    assert type(got).__name__ == "BaseModelOutputWithPast"
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        assert error_on_real_tokens(g, w, mask) <= 1e-5
    assert error_on_real_tokens(got.last_hidden_state, want.last_hidden_state, mask) <= 1e-5
    assert got.last_hidden_state[~mask.bool()].abs().max() == 0


def test_attention_is_causal(tokenizer, texts):
    """A token's vector does not depend on the tokens after it: the first 20 tokens of a text alone give the same
    vectors as inside the whole text (transformers' too); attending both ways would change them."""
    hf = qwen3_model()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = batch(tokenizer, texts[:1], left=False)
    with torch.no_grad():
        whole = fb(ids).last_hidden_state[0, :20]
        prefix = fb(ids[:, :20]).last_hidden_state[0]
        want = hf(ids[:, :20]).last_hidden_state[0]
    assert (whole - prefix).abs().max() <= 1e-5 and (prefix - want).abs().max() <= 1e-5


def test_kernels_through_the_interpreter(tokenizer, texts):
    """kernels="triton": the grouped QKV GEMM, the causal rotary attention kernel, the RMSNorm residual form, the
    SwiGLU epilogue, on real text past one key block."""
    hf = qwen3_model()
    fb = fastbert.BertModel.from_hf(hf, kernels="triton")
    ids, mask = batch(tokenizer, texts[:3], left=True)
    with torch.no_grad():
        assert error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state,
                                    hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def test_qwen3_embedding_06b_head_geometry(tokenizer, texts):
    """Qwen3-Embedding-0.6B's layer: hidden 1,024, 16 query heads and 8 key/value heads of 128 (nh * hd = 2,048, twice
    the hidden size), SwiGLU 3,072, theta 1,000,000; one layer and a small vocabulary keep it cheap."""
    hf = qwen3_model(qk_gain=1.0, hidden=1024, heads=16, kv_heads=8, head_dim=128, layers=1, intermediate=3072,
                  vocab=1000, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    assert fb.layers[0].self_attn.q_proj.weight.shape == (2048, 1024)
    assert fb.layers[0].self_attn.o_proj.weight.shape == (1024, 2048)
    ids, mask = batch(tokenizer, texts[:3], left=True)
    ids = ids % 1000
    with torch.no_grad():
        assert error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state,
                                    hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def test_the_model_holds_hf_modules_and_keys():
    hf = qwen3_model()
    fb = fastbert.AutoModel.from_hf(hf, kernels="torch")
    assert type(fb).__name__ == "Qwen3Model" and isinstance(fb, fastbert.BertModel)
    assert list(fb.state_dict()) == list(hf.state_dict())
    assert fb.layers[0].self_attn.q_norm is hf.layers[0].self_attn.q_norm and fb.norm is hf.norm


def test_sliding_layers_are_refused():
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        fastbert.BertModel(qwen3_config(use_sliding_window=True, sliding_window=8, max_window_layers=0))


@pytest.fixture(scope="module")
def qwen3_hub(tmp_path_factory, tokenizer):
    return qwen3_st_folder(tmp_path_factory.mktemp("qwen3-hub"), tokenizer)


def test_hub_checkpoint_loads(qwen3_hub, tokenizer, texts):
    hf, folder = qwen3_hub
    fb = fastbert.AutoModel.from_pretrained(str(folder), kernels="torch")
    stock = transformers.AutoModel.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    assert type(stock).__name__ == "Qwen3Model"
    ids, mask = batch(tokenizer, texts, left=True)
    with torch.no_grad():
        want = stock(ids, attention_mask=mask).last_hidden_state
        assert error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state, want, mask) <= 1e-5
        assert error_on_real_tokens(hf(ids, attention_mask=mask).last_hidden_state, want, mask) == 0


@pytest.mark.parametrize("how", [{}, {"prompt_name": "query"}, {"prompt": "Query: "}],
                         ids=["document", "query", "prompt"])
def test_encode_equals_sentence_transformers(qwen3_hub, texts, how):
    """Last-token pooling of left-padded batches (sentence-transformers) against fastbert's padding-free batches,
    Normalize, the folder's query instruction: every component within 1e-5."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    _, folder = qwen3_hub
    stock = st.SentenceTransformer(str(folder), device="cpu")
    assert stock.tokenizer.padding_side == "left"
    want = stock.encode(texts, batch_size=4, **how)
    got = fastbert.encode(str(folder), texts, device="cpu", kernels="torch", **how)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5
    if how:  # the prompt reached the model: the vectors moved far past the bar
        assert np.abs(got - stock.encode(texts, batch_size=4)).max() > 1e-3


def test_encode_right_padded_last_token(qwen3_hub, texts):
    """The same folder with the tokenizer padding right: sentence-transformers' last token is then the last real one
    of each row, which is what fastbert pools either way."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    _, folder = qwen3_hub
    stock = st.SentenceTransformer(str(folder), device="cpu")
    stock.tokenizer.padding_side = "right"
    want = stock.encode(texts, batch_size=4, prompt_name="query")
    got = fastbert.encode(str(folder), texts, device="cpu", kernels="torch", prompt_name="query")
    assert np.abs(got - want).max() <= 1e-5


def test_optimize_refuses_a_model_that_generates():
    """Qwen3ForCausalLM generates with a key/value cache, which fastbert's encoder does not keep: optimize refuses
    it, naming the base model, and leaves it as it was; the base model itself swaps in. BERT's LM head, built as an
    encoder, still swaps in."""
    hf = transformers.Qwen3ForCausalLM(qwen3_config()).eval()
    with pytest.raises(ValueError, match="generates text.*module 'model'"):
        fastbert.optimize(hf)
    assert type(hf.model).__name__ == "Qwen3Model"
    assert isinstance(fastbert.optimize(hf.model), fastbert.BertModel)
    bert = transformers.BertLMHeadModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=64))
    assert isinstance(fastbert.optimize(bert).bert, fastbert.BertModel)
