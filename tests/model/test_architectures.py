"""Every family fastbert runs against each architecture's own transformers class, random weights, fp32, on both
backends ("torch": the twins; "triton": the kernels, through Triton's interpreter on CPU). RoBERTa / XLM-RoBERTa /
CamemBERT count positions from padding_idx + 1 over the non-padding tokens (a padding_idx token inside a sentence
stays at padding_idx); ELECTRA's embeddings are narrower than its layers, widened by a projection; BERT-architecture
embedding models (BGE, E5, GTE) have no pooler; DistilBERT has no token types, no pooler and HF's module names of
its own; MPNet counts positions like RoBERTa (padding_idx 1) and adds a relative position bias to every attention
score; ModernBERT is pre-norm with a final norm, rotary q/k, a sliding window on its local layers and a gated MLP,
with and without its optional biases. Bar: max |fastbert - HF| <= 1e-5 on real tokens, every hidden state, and the
pooler."""
import copy

import pytest
import torch
import transformers
from helpers import ARCH_VOCAB as VOCAB
from helpers import (
    ARCHS,
    DEVICE,
    assert_close_on,
    type_kwargs,
)
from helpers import arch_inputs as inputs
from helpers import random_arch_model as random_hf
from safetensors.torch import load_file

import fastbert

BACKENDS = ("torch", "triton")


def pooler_of(hf):
    return getattr(hf, "pooler", None)


@pytest.fixture(scope="module", params=ARCHS)
def hf(request):
    return random_hf(request.param)


@pytest.fixture(scope="module", params=BACKENDS)
def fb(request, hf):
    return fastbert.BertModel.from_hf(hf, kernels=request.param)


def check_outputs(out, ref, hf, ids, mask):
    assert type(out).__name__ == type(ref).__name__  # HF's output class of that architecture (fields and tuple order)
    for h_out, h_ref in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert_close_on(h_out, h_ref, mask)
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask)
    if pooler_of(hf) is None:
        assert getattr(out, "pooler_output", None) is None
        return
    # the pooler reads each row's first real token: HF's pooler_output where that is position 0, else HF's pooler
    # applied to HF's own hidden state of that token
    for b in range(ids.shape[0]):
        first = mask[b].nonzero()[0, 0]
        want = ref.pooler_output[b] if first == 0 else torch.tanh(hf.pooler.dense(ref.last_hidden_state[b, first]))
        assert (out.pooler_output[b] - want).abs().max() <= 1e-5, f"pooler row {b}"


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_matches_hf(hf, fb, padding):
    ids, tt, mask = inputs(hf, padding)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, **type_kwargs(tt), output_hidden_states=True)
        out = fb(ids, attention_mask=mask, **type_kwargs(tt), output_hidden_states=True)
    check_outputs(out, ref, hf, ids, mask)


def test_padded_execution_matches_hf(hf):
    """padding_free=False: HF's values at padded positions too."""
    fb = fastbert.BertModel.from_hf(hf, kernels="torch", padding_free=False)
    ids, tt, mask = inputs(hf, "right")
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, **type_kwargs(tt), output_hidden_states=True)
        out = fb(ids, attention_mask=mask, **type_kwargs(tt), output_hidden_states=True)
    for h_out, h_ref in zip(out.hidden_states, ref.hidden_states, strict=True):
        assert_close_on(h_out, h_ref, mask, padding_free=False)


def test_packed_input_matches_each_sequence_alone(hf, fb):
    """cu_seqlens input: positions restart in every sequence (RoBERTa's from padding_idx + 1, counting only
    non-padding tokens), as HF computes them for each sequence run alone."""
    ids, tt, mask = inputs(hf, "right")
    lengths = mask.sum(1).tolist()
    packed = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])
    packed_tt = None if tt is None else torch.cat([tt[b, :n] for b, n in enumerate(lengths)])
    cu = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    with torch.no_grad():
        out = fb(packed, **type_kwargs(packed_tt), cu_seqlens=cu)
        for b, n in enumerate(lengths):
            ref = hf(ids[b:b + 1, :n], **type_kwargs(None if tt is None else tt[b:b + 1, :n]))
            got = out.last_hidden_state[cu[b]:cu[b + 1]]
            assert (got - ref.last_hidden_state[0]).abs().max() <= 1e-5, f"sequence {b}"
            if pooler_of(hf) is not None:
                assert (out.pooler_output[b] - ref.pooler_output[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("padding", ["right", "left"])
def test_inputs_embeds_match_hf(hf, fb, padding):
    """From inputs_embeds HF cannot see padding: positions run on over every column (RoBERTa: from
    padding_idx + 1). Width: ELECTRA's embedding_size."""
    ids, tt, mask = inputs(hf, padding)
    embeds = hf.get_input_embeddings()(ids).detach()
    assert embeds.shape[-1] == fb.get_input_embeddings().embedding_dim
    with torch.no_grad():
        ref = hf(inputs_embeds=embeds, attention_mask=mask, **type_kwargs(tt), output_hidden_states=True)
        out = fb(inputs_embeds=embeds, attention_mask=mask, **type_kwargs(tt), output_hidden_states=True)
    check_outputs(out, ref, hf, ids, mask)


def test_longest_sequence_and_one_past_it(hf):
    """The usable length: max_position_embeddings, or for RoBERTa max_position_embeddings - padding_idx - 1; ModernBERT
    (rotary) runs past max_position_embeddings as HF does."""
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    limit = 24
    assert fb.embeddings.max_length == limit
    ids = torch.randint(2, VOCAB, (2, limit), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        ref, out = hf(ids, attention_mask=mask), fb(ids, attention_mask=mask)
    assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask)
    longer = torch.full((1, limit + 1), 5, device=DEVICE)
    if fb.embeddings.position_embeddings is None:  # rotary (ModernBERT) or relative only (DeBERTa-v3) positions: no
        # table runs out, and HF refuses nothing either
        with torch.no_grad():
            assert (fb(longer).last_hidden_state - hf(longer).last_hidden_state).abs().max() <= 1e-5
        return
    with pytest.raises(ValueError, match=f"sequence length {limit + 1} exceeds .*{limit}"):
        fb(longer)


def test_from_pretrained_picks_by_model_type(hf, tmp_path):
    """AutoModel (and BertModel, which runs the whole family) load a saved HF model of each architecture, base or
    head checkpoint; save_pretrained writes what that architecture's transformers class loads back."""
    hf.save_pretrained(tmp_path / "base")
    head_cls = {"bert": transformers.BertForSequenceClassification,
                "electra": transformers.ElectraForSequenceClassification,
                "roberta": transformers.RobertaForSequenceClassification,
                "xlm-roberta": transformers.XLMRobertaForSequenceClassification,
                "camembert": transformers.CamembertForSequenceClassification,
                "distilbert": transformers.DistilBertForSequenceClassification,
                "mpnet": transformers.MPNetForSequenceClassification,
                "modernbert": getattr(transformers, "ModernBertForSequenceClassification", None),
                "deberta-v2": transformers.DebertaV2ForSequenceClassification,
                "jina_embeddings_v3": getattr(transformers, "JinaEmbeddingsV3ForSequenceClassification", None),
                "nomic_bert": getattr(transformers, "NomicBertForSequenceClassification", None),
                "gte": getattr(transformers, "GteForSequenceClassification", None),
                "eurobert": getattr(transformers, "EuroBertForSequenceClassification", None)}[hf.config.model_type]
    head = head_cls(hf.config)
    head.base_model.load_state_dict(hf.state_dict(), strict=False)
    head.save_pretrained(tmp_path / "head")
    ids, tt, mask = inputs(hf, "right")
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, **type_kwargs(tt))
    for folder in ("base", "head"):
        fb = fastbert.AutoModel.from_pretrained(str(tmp_path / folder), kernels="torch", device=DEVICE)
        assert fb.config.model_type == hf.config.model_type
        # a pooler exactly when the checkpoint has one (of the heads, only BERT's sequence classifier keeps one)
        has_pooler = pooler_of(hf) is not None if folder == "base" else hf.config.model_type == "bert"
        assert (fb.pooler is not None) == has_pooler
        with torch.no_grad():
            out = fb(ids, attention_mask=mask, **type_kwargs(tt))
        assert_close_on(out.last_hidden_state, ref.last_hidden_state, mask)
    fb = fastbert.AutoModel.from_pretrained(str(tmp_path / "base"), kernels="torch")
    fb.save_pretrained(tmp_path / "again")
    back = type(hf).from_pretrained(tmp_path / "again", attn_implementation="eager").eval().to(DEVICE)
    with torch.no_grad():
        again = back(ids, attention_mask=mask, **type_kwargs(tt))
    assert (again.last_hidden_state - ref.last_hidden_state).abs().max() <= 1e-6
    # the very file transformers writes: its keys (the Hub's layout where transformers converts on loading, e.g.
    # NomicBERT's attn.Wqkv) and tensors; save_original_format=False keeps transformers' module names, as there
    stock, ours = (load_file(tmp_path / f / "model.safetensors") for f in ("base", "again"))
    assert sorted(ours) == sorted(stock) and all(torch.equal(ours[k], stock[k]) for k in stock)
    fb.save_pretrained(tmp_path / "names", save_original_format=False)
    assert sorted(load_file(tmp_path / "names" / "model.safetensors")) == sorted(hf.state_dict())


def test_electra_projection_and_no_pooler():
    hf = random_hf("electra")
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    assert fb.embeddings_project is hf.embeddings_project and fb.embeddings_project.in_features == 32
    assert fb.pooler is None
    with pytest.raises(ValueError, match="ELECTRA has no pooler"):
        fastbert.BertModel(hf.config, add_pooling_layer=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_mpnet_relative_bias_kernel_at_head_dim_64_against_hf(dtype):
    """all-mpnet-base-v2's head dim (64) on the Triton path (the interpreter on CPU), ragged rows of up to 140 tokens
    (past the 128 where the buckets stop changing, across the kernel's key blocks), against HF in fp32: fp32 1e-5;
    fp16 within twice HF's own fp16 error (fastbert/numerics.py)."""
    from fastbert.numerics import error_bound, max_error
    hf = random_hf("mpnet", hidden=128, heads=2, layers=2, intermediate=160, max_len=160)
    ids = torch.randint(2, VOCAB, (3, 140), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 70:] = 0
    mask[2, 9:] = 0
    real = mask.bool()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
        if dtype == torch.float32:
            baseline = 0.0
        else:
            baseline = max_error(copy.deepcopy(hf).to(dtype)(ids, attention_mask=mask).last_hidden_state, ref, real)
        fb = fastbert.BertModel.from_hf(copy.deepcopy(hf).to(dtype), kernels="triton")
        out = fb(ids, attention_mask=mask).last_hidden_state
    assert max_error(out, ref, real) <= error_bound(dtype, baseline), (max_error(out, ref, real), baseline)
