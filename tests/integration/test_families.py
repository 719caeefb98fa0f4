"""DistilBERT, MPNet, ModernBERT, DeBERTa-v2, Jina-Embeddings-v3, NomicBERT and GTE as their users hold them: every
head through fastbert.optimize and restore, saved and reloaded, and sentence-transformers models on them (a folder
shaped like all-mpnet-base-v2's: mean pooling, Normalize; DistilBERT, ModernBERT, DeBERTa-v2 and GTE ones with CLS
pooling; Jina-v3 and NomicBERT ones with mean pooling, NomicBERT's with its prompts) through fastbert.encode and
SentenceTransformer with fastbert inside. Random weights, built with transformers' and sentence-transformers' own
classes (no model hub here); fp32, CPU, the PyTorch path. Bar: 1e-5 on real tokens; cosine >= 0.99999 for
embeddings."""
import copy
import os
import re

import numpy as np
import pytest
import torch
import transformers
from helpers import (
    cosines,
    deberta_config,
    eurobert_config,
    family_st_folder,
    has_modernbert,
    has_rotary_post_norm,
    modernbert_config,
    optional,
    perturb_,
    rotary_post_norm_config,
)

import fastbert

B, S, VOCAB = 3, 10, 99
PADDINGS = ("right", "left", "fully_padded_row")


def masks(kind):
    mask = torch.ones(B, S, dtype=torch.long)
    if kind == "right":
        mask[1, 6:] = 0
        mask[2, 2:] = 0
    elif kind == "left":
        mask[1, :4] = 0
        mask[2, :7] = 0
    else:
        mask[1, 5:] = 0
        mask[2] = 0
    return mask


def config(family, **extra):
    """Small random configs. DistilBERT's reference runs eager attention: for a fully padded row, HF's sdpa path and
    its eager path disagree, and fastbert gives eager's (uniform attention over the row, docs/masks.md)."""
    if family == "distilbert":
        return transformers.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=100,
                                             max_position_embeddings=32, attn_implementation="eager", **extra)
    if family == "modernbert":  # 3 layers (full, sliding, sliding), a window of +-2: rows of 10 cross it
        return modernbert_config(hidden=64, heads=4, layers=3, intermediate=100, max_len=32, **extra)
    if family == "deberta-v2":  # v3's shape, small (buckets 8, max_relative 16); the MLM head's non-legacy form
        return deberta_config(hidden=64, heads=4, layers=2, intermediate=100, max_len=32, legacy=False, **extra)
    if family in ("jina_embeddings_v3", "nomic_bert", "gte"):  # rotary q/k; NomicBERT and GTE: a gated MLP;
        # eager attention, as DistilBERT's, for the fully padded row
        return rotary_post_norm_config(family, hidden=64, heads=4, layers=2, intermediate=100, max_len=32, **extra)
    if family == "eurobert":  # grouped-query attention: 2 key/value heads for 4 query heads; biases on
        return eurobert_config(hidden=64, heads=4, layers=2, intermediate=100, max_len=32, gqa=True, biases=True,
                               **extra)
    return transformers.MPNetConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=100, max_position_embeddings=34, **extra)


HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMaskedLM",
         "ForMultipleChoice")
CLASS = {"distilbert": "DistilBert", "mpnet": "MPNet", "deberta-v2": "DebertaV2",
         **({"modernbert": "ModernBert"} if has_modernbert() else {}),
         **({"jina_embeddings_v3": "JinaEmbeddingsV3", "nomic_bert": "NomicBert", "gte": "Gte",
             "eurobert": "EuroBert"} if has_rotary_post_norm() else {})}
# every head transformers defines for each family (NomicBERT and GTE have no question answering or multiple choice)
FAMILY_HEADS = [(family, head) for family in CLASS for head in HEADS if hasattr(transformers, CLASS[family] + head)]


def head_model(family, head):
    cfg = config(family, num_labels=2 if head == "ForQuestionAnswering" else 3)
    torch.manual_seed(0)
    return perturb_(getattr(transformers, CLASS[family] + head)(cfg), weight_std=0.05).eval()


def head_call(head, ids, mask):
    if head == "ForMultipleChoice":  # [B, choices, S]: the head flattens it to [B * choices, S]
        return dict(input_ids=ids[:, None].expand(B, 2, S).contiguous(),
                    attention_mask=mask[:, None].expand(B, 2, S).contiguous())
    return dict(input_ids=ids, attention_mask=mask)


def outputs(head, out):
    """(name, value, per-token?) of the head's outputs."""
    if head == "ForQuestionAnswering":
        return [("start_logits", out.start_logits, True), ("end_logits", out.end_logits, True)]
    return [("logits", out.logits, head in ("ForTokenClassification", "ForMaskedLM"))]


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize(("family", "head"), FAMILY_HEADS)
def test_heads_before_during_and_after_optimize(family, head, padding):
    """Real tokens carry HF's numbers padding-free (the default); a head that reads position 0 of each row (the
    sequence heads) gets HF's numbers where position 0 is a real token, and everywhere with padding_free=False
    (HF's values at padded positions too). restore gives back HF's own encoder, and the same numbers bit for bit."""
    model = head_model(family, head)
    encoder = model.base_model
    ids = torch.randint(2, VOCAB, (B, S), generator=torch.Generator().manual_seed(1))  # never MPNet's pad id 1
    mask = masks(padding)
    call = head_call(head, ids, mask)
    with torch.no_grad():
        before = outputs(head, model(**call))
        for padding_free in (True, False):
            optimized = fastbert.optimize(copy.deepcopy(model), kernels="torch", padding_free=padding_free)
            assert isinstance(optimized.base_model, fastbert.BertModel)
            during = outputs(head, optimized(**call))
            for (name, want, per_token), (_, got, _) in zip(before, during, strict=True):
                if per_token:
                    rows = mask.bool()
                elif padding_free:  # one value per row (per choice): the rows whose position 0 is real
                    rows = mask[:, 0].bool()
                else:
                    rows = torch.ones(B, dtype=torch.bool)
                if head == "ForMultipleChoice":
                    want, got = want.view(B, -1), got.view(B, -1)
                want, got = want[rows], got[rows]
                # EuroBERT's sequence head averages over the mask: HF's own 0 / 0 on a fully padded row, NaN in both
                nan = want.isnan()
                assert torch.equal(got.isnan(), nan), (name, padding_free)
                assert (got[~nan] - want[~nan]).abs().max() <= 1e-5, (name, padding_free)
        assert fastbert.optimize(model, kernels="torch") is model
        assert fastbert.restore(model).base_model is encoder
        after = outputs(head, model(**call))
    for (name, want, _), (_, got, _) in zip(before, after, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=name)  # bit for bit (NaN too)


@pytest.mark.parametrize("family", CLASS)
def test_optimized_head_saves_what_transformers_loads(family, tmp_path):
    """save_pretrained of a head with fastbert inside writes HF's keys: the stock class loads every one of them
    (nothing missing, nothing unexpected) with the same logits, and fastbert.AutoModel loads its encoder."""
    model = head_model(family, "ForSequenceClassification")
    ids, mask = torch.randint(2, VOCAB, (B, S), generator=torch.Generator().manual_seed(1)), masks("right")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    fastbert.optimize(model, kernels="torch").save_pretrained(tmp_path)
    back, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    encoder = fastbert.AutoModel.from_pretrained(str(tmp_path), kernels="torch")
    assert encoder.family.name == family and encoder.pooler is None  # the heads keep no pooler
    with torch.no_grad():
        assert (back.eval()(input_ids=ids, attention_mask=mask).logits - want).abs().max() <= 1e-5
        ref = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        got = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (got - ref)[mask.bool()].abs().max() <= 1e-5


# ---- sentence-transformers models on both families ------------------------------------------------------------------
@pytest.fixture(scope="module")
def texts(minilm_path):
    """Paragraphs of the bundled model's card (real text no one here wrote), short and long (past max_seq_length)."""
    with open(os.path.join(minilm_path, "README.md"), encoding="utf-8") as f:
        card = f.read()
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", card) if p.strip()]
    return paragraphs[:12] + [card[:3000]]


@pytest.mark.parametrize("family", CLASS)
def test_sentence_transformers_folder_through_encode_and_optimize(family, minilm_path, texts, tmp_path):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    folder = family_st_folder(family, minilm_path, tmp_path)
    stock = st.SentenceTransformer(str(folder), device="cpu")
    assert type(stock[0].auto_model).__name__ == CLASS[family] + "Model"
    want = stock.encode(texts, batch_size=4)
    got = fastbert.encode(str(folder), texts, device="cpu", kernels="torch")
    assert got.shape == want.shape and cosines(got, want).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-5)

    ours = fastbert.optimize(st.SentenceTransformer(str(folder), device="cpu"), kernels="torch")
    assert isinstance(ours[0].auto_model, fastbert.BertModel)
    assert cosines(ours.encode(texts, batch_size=4), want).min() >= 0.99999
    ours.save(str(tmp_path / "again"))  # saved with fastbert inside: stock sentence-transformers reads it back
    again = st.SentenceTransformer(str(tmp_path / "again"), device="cpu").encode(texts, batch_size=4)
    assert cosines(again, want).min() >= 0.99999
    assert type(fastbert.restore(ours)[0].auto_model).__name__ == CLASS[family] + "Model"


@pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no NomicBERT (5.24+)")
@pytest.mark.parametrize("truncate_dim", [None, 16, 64, 100], ids=["full", "16", "64", "past-the-width"])
def test_nomic_prompts_and_matryoshka_truncation_as_sentence_transformers(minilm_path, texts, tmp_path,
                                                                            truncate_dim):
    """nomic-embed-text's use: each text behind its task prefix (prompt_name "query" / "document", or a prompt
    given), and Matryoshka's truncate_dim (per call, or the encoder's), cut after Normalize as sentence-transformers
    cuts it: the same vectors, norms included (a cut normalised vector is not renormalised)."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    folder = family_st_folder("nomic_bert", minilm_path, tmp_path)
    stock = st.SentenceTransformer(str(folder), device="cpu")
    encoder = fastbert.SentenceEncoder.from_pretrained(str(folder), device="cpu", kernels="torch")
    for how in ({"prompt_name": "query"}, {"prompt_name": "document"}, {"prompt": "classification: "}):
        want = stock.encode(texts, batch_size=4, truncate_dim=truncate_dim, **how)
        got = encoder.encode(texts, truncate_dim=truncate_dim, **how)
        assert got.shape == want.shape and cosines(got, want).min() >= 0.99999, how
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-5)
    plain = stock.encode(texts, batch_size=4, truncate_dim=truncate_dim)
    assert np.abs(plain - want).max() > 1e-4  # the prompt changed the vectors (far past the parity bar above)
    if truncate_dim is not None:  # the encoder's own default, and fastbert.encode's per-call keyword
        cut = fastbert.SentenceEncoder.from_pretrained(str(folder), device="cpu", kernels="torch",
                                                       truncate_dim=truncate_dim)
        assert cosines(cut.encode(texts, prompt_name="query"),
                       stock.encode(texts, prompt_name="query", truncate_dim=truncate_dim)).min() >= 0.99999
        assert fastbert.encode(str(folder), texts[:2], truncate_dim=truncate_dim, kernels="torch", device="cpu"
                               ).shape == (2, min(truncate_dim, 64))
    with pytest.raises(ValueError, match="truncate_dim must be None or an integer >= 1"):
        encoder.encode(texts[:1], truncate_dim=0)


@pytest.mark.skipif(not has_modernbert(), reason="this transformers has no ModernBERT (4.48+)")
def test_cli_encode_on_a_modernbert_folder(minilm_path, texts, tmp_path):
    """`python -m fastbert encode` on a sentence-transformers folder built on ModernBERT: stock
    sentence-transformers' vectors (normalised, as the CLI writes them)."""
    import subprocess
    import sys
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    folder = family_st_folder("modernbert", minilm_path, tmp_path)
    lines = [t.replace("\n", " ") for t in texts]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "fastbert", "encode", "--model", str(folder), "--input",
                          str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.npy"), "--kernels", "torch"],
                         env=dict(os.environ, TRITON_INTERPRET="0", HF_HUB_OFFLINE="1"), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    want = st.SentenceTransformer(str(folder), device="cpu").encode(lines, normalize_embeddings=True)
    assert cosines(np.load(tmp_path / "out.npy"), want).min() >= 0.99999
