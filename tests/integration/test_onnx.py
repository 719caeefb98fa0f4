"""ONNX export of the PyTorch path: dynamic batch and sequence axes, onnxruntime on CPU against fastbert (fp32 1e-5)."""
import numpy as np
import onnxruntime  # noqa: E402  (a test dependency: setup.py's test extras)
import pytest
import torch
from helpers import has_modernbert, has_rotary_post_norm, random_arch_model, random_hf_bert

import fastbert


def run(path, feeds):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v.numpy() for k, v in feeds.items()})


def batch(B, S, vocab, seed, left=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(1, B):
        n = 1 + (b * 7) % S
        if left:
            mask[b, :S - n] = 0
        else:
            mask[b, n:] = 0
    return ids, mask


def test_bert_model_with_dynamic_axes(tmp_path):
    hf = random_hf_bert(hidden=64, heads=4, layers=2, intermediate=100, vocab=80, max_pos=40, types=2)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto")  # the export records the twins, the choice stays
    path = fastbert.export_onnx(fb, tmp_path / "bert.onnx")
    assert fb.kernels == dict.fromkeys(fastbert.OPS, "auto")
    for B, S, left in ((2, 16, False), (5, 33, False), (1, 1, False), (3, 40, True)):
        ids, mask = batch(B, S, 80, seed=S, left=left)
        types = (torch.arange(S) > S // 2).long().expand(B, S).contiguous()
        hidden, pooled = run(path, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})
        with torch.no_grad():
            want = fb.set_kernels("torch")(ids, attention_mask=mask, token_type_ids=types)
        fb.set_kernels("auto")
        assert hidden.shape == (B, S, 64) and pooled.shape == (B, 64)
        assert np.abs(hidden - want.last_hidden_state.numpy()).max() <= 1e-5
        assert np.abs(pooled - want.pooler_output.numpy()).max() <= 1e-5
        real = mask.bool().numpy()
        with torch.no_grad():  # and HF on real tokens
            ref = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state.numpy()
        assert np.abs(hidden - ref)[real].max() <= 1e-5


def test_sentence_encoder_embeddings(tmp_path, minilm_path):
    """The bundled sentence-transformers model (mean pooling, Normalize) as one ONNX graph, against fastbert.encode."""
    encoder = fastbert.SentenceEncoder.from_pretrained(minilm_path, kernels="torch")
    path = fastbert.export_onnx(encoder, tmp_path / "minilm.onnx")
    texts = ["A man is eating food.", "Hi", "The new movie is awesome, I would watch it again tomorrow night."]
    enc = encoder.tokenizer(texts, padding=True, return_tensors="pt")
    (got,) = run(path, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    want = encoder.encode(texts, progress=False)
    assert got.shape == want.shape == (3, 384)
    assert np.abs(got - want).max() <= 1e-5


def test_refuses_other_objects(tmp_path):
    with pytest.raises(TypeError, match="export_onnx takes a fastbert.BertModel or a fastbert.SentenceEncoder"):
        fastbert.export_onnx(torch.nn.Linear(2, 2), tmp_path / "x.onnx")


@pytest.mark.parametrize("arch", ["distilbert", "mpnet", pytest.param("modernbert", marks=pytest.mark.skipif(
    not has_modernbert(), reason="this transformers has no ModernBERT (4.48+)")), "deberta-v2",
    *(pytest.param(arch, marks=pytest.mark.skipif(not has_rotary_post_norm(), reason="transformers 5.24+ families"))
      for arch in ("gte-notypes", "eurobert-gqa"))])
def test_families_without_token_types(tmp_path, arch):
    """DistilBERT, MPNet, ModernBERT, GTE without token types and EuroBERT export with input_ids and attention_mask
    only; MPNet's relative bias table, ModernBERT's rotary tables and sliding window, DeBERTa-v3's disentangled terms
    and column table, GTE's gated MLP, EuroBERT's RMSNorms and grouped key/value heads are part of the graph. HF's
    numbers
    on real tokens, at lengths the export never saw."""
    hf = random_arch_model(arch)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    path = fastbert.export_onnx(fb, tmp_path / f"{arch}.onnx")
    assert [i.name for i in onnxruntime.InferenceSession(str(path)).get_inputs()] == ["input_ids", "attention_mask"]
    for B, S, left in ((2, 9, False), (3, 24, True)):
        ids, mask = batch(B, S, 99, seed=S, left=left)
        ids = ids.clamp(min=2)  # never MPNet's padding_idx inside a sentence
        outputs = run(path, {"input_ids": ids, "attention_mask": mask})
        with torch.no_grad():
            ref = hf(ids, attention_mask=mask).last_hidden_state.numpy()
        assert np.abs(outputs[0] - ref)[mask.bool().numpy()].max() <= 1e-5
