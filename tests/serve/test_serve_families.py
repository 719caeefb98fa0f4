"""Every family fastbert runs, served through the ASGI app in this process (the bundled MiniLM, BERT, is served by a
live process in test_serve_live.py): a sentence-transformers folder of each family (random weights, saved by
sentence-transformers itself) answers /v1/embeddings with SentenceTransformer.encode's vectors (max |delta| <= 1e-5,
the same norms) and /embed with them normalised; a *ForSequenceClassification folder of other families answers
/predict with the softmax of transformers' own logits, under the checkpoint's labels. fp32, CPU, the PyTorch path."""
import numpy as np
import pytest
import torch
from helpers import (
    FP32_TOL,
    _family_tokenizer,
    deberta_config,
    family_st_folder,
    gemma3_st_folder,
    has_decoder_embedders,
    has_modernbert,
    has_rotary_post_norm,
    max_delta,
    modernbert_config,
    optional,
    perturb_,
    qwen3_st_folder,
    real_texts,
    serving,
)

FAMILIES = ["distilbert", "mpnet", "roberta", "xlm-roberta", "camembert", "electra", "deberta-v2",
            *(["modernbert"] if has_modernbert() else []),
            *(["jina_embeddings_v3", "nomic_bert", "gte", "eurobert"] if has_rotary_post_norm() else [])]


@pytest.fixture(scope="module")
def texts():
    return real_texts(10) + ["", "a"]  # an empty text and a one-word one too


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_serves_sentence_transformers_vectors(family, minilm_path, tmp_path, texts):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    serve = optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")
    folder = family_st_folder(family, minilm_path, tmp_path)
    want = st.SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=4)
    # auto_truncate: a text past max_seq_length is cut there, as sentence-transformers cuts it
    with serving(serve.app(str(folder), device="cpu", kernels="torch", auto_truncate=True)) as client:
        openai = client.post("/v1/embeddings", json={"input": texts}).json()
        tei = client.post("/embed", json={"inputs": texts}).json()
    got = np.array([d["embedding"] for d in openai["data"]], dtype=np.float32)
    assert got.shape == want.shape and max_delta(got, want) <= FP32_TOL, family
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-5)
    tei = np.array(tei, dtype=np.float64)
    unit = want / np.linalg.norm(want.astype(np.float64), axis=1, keepdims=True)  # normalize: true, TEI's default
    assert max_delta(tei, unit) <= FP32_TOL, family
    np.testing.assert_allclose(np.linalg.norm(tei, axis=1), 1.0, rtol=1e-6)  # normalize: true, TEI's default


def head_folder(family, minilm_path, root, labels=("negative", "neutral", "positive")):
    """A *ForSequenceClassification checkpoint of `family` (random non-trivial weights) with named labels, and the
    family's tokenizer class over BERT's vocabulary (the bundled model's)."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    common = dict(num_labels=len(labels), id2label=dict(enumerate(labels)),
                  label2id={label: i for i, label in enumerate(labels)})
    if family == "distilbert":
        cfg = transformers.DistilBertConfig(vocab_size=len(tokenizer), dim=64, n_layers=2, n_heads=4, hidden_dim=100,
                                            pad_token_id=0, **common)
        tokenizer = transformers.DistilBertTokenizerFast.from_pretrained(minilm_path)
    elif family == "deberta-v2":
        cfg = deberta_config(hidden=64, heads=4, layers=2, intermediate=100, max_len=512,
                             vocab_size=len(tokenizer), **common)
    elif family == "modernbert":
        cfg = modernbert_config(hidden=64, heads=4, layers=3, intermediate=100, max_len=512, window=8,
                                vocab_size=len(tokenizer), **common)
    else:
        cfg = transformers.RobertaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=100, max_position_embeddings=514,
                                         pad_token_id=0, **common)
    torch.manual_seed(0)
    head = transformers.AutoModelForSequenceClassification.from_config(cfg)
    folder = root / family
    perturb_(head, weight_std=0.05).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


HEAD_FAMILIES = ["distilbert", "roberta", "deberta-v2", *(["modernbert"] if has_modernbert() else [])]


@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_classifiers_of_other_families_predict_transformers_softmax(family, minilm_path, tmp_path, texts):
    import transformers
    serve = optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")
    folder = head_folder(family, minilm_path, tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    pairs = [[texts[i], texts[i + 1]] for i in range(4)]
    cut = dict(padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.no_grad():
        want_single = hf(**tokenizer(texts, **cut)).logits.double().softmax(-1)
        want_pairs = hf(**tokenizer([p[0] for p in pairs], [p[1] for p in pairs], **cut)).logits.double().softmax(-1)
    with serving(serve.app(folder, device="cpu", kernels="torch", auto_truncate=True)) as client:
        info = client.get("/info").json()
        single = client.post("/predict", json={"inputs": texts}).json()
        paired = client.post("/predict", json={"inputs": pairs}).json()
    assert info["model_type"] == {"classifier": {"id2label": {"0": "negative", "1": "neutral", "2": "positive"},
                                                 "label2id": {"negative": 0, "neutral": 1, "positive": 2}}}
    for got, want in ((single, want_single), (paired, want_pairs)):
        assert len(got) == len(want)
        for predictions, row in zip(got, want):
            by_label = {p["label"]: p["score"] for p in predictions}
            expected = dict(zip(("negative", "neutral", "positive"), row.tolist()))
            assert by_label.keys() == expected.keys()
            assert max(abs(by_label[k] - expected[k]) for k in expected) <= 1e-5, (family, by_label, expected)
            assert [p["score"] for p in predictions] == sorted(by_label.values(), reverse=True)


@pytest.mark.skipif(not has_decoder_embedders(), reason="fastbert runs Qwen3 and Gemma 3 from transformers 5 on")
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_decoder_embedders_serve_their_prompts_per_request(family, minilm_path, tmp_path, texts):
    """Qwen3-Embedding's folder (last-token pooling, Normalize, the query instruction) and EmbeddingGemma's (mean
    pooling, two Dense layers, Normalize, query / document prompts): /v1/embeddings and /embed with the prompt chosen
    per request equal SentenceTransformer.encode with that prompt_name, every component within 1e-5; a request
    without a prompt_name gets the plain vectors, which differ."""
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    serve = optional("fastbert.serve", "the serve extra (fastapi, uvicorn, prometheus-client) is a test extra")
    tokenizer = _family_tokenizer(family, minilm_path)
    if family == "qwen3":
        folder = qwen3_st_folder(tmp_path, tokenizer)[1]
    else:
        folder = gemma3_st_folder(tmp_path, tokenizer)[1] / "st"
    stock = st.SentenceTransformer(str(folder), device="cpu")
    real = [t for t in texts if t]  # sentence-transformers pools an empty text's specials only; kept to real text
    want = {name: stock.encode(real, batch_size=4, prompt_name=name) for name in ("query", "document")}
    plain = stock.encode(real, batch_size=4)
    with serving(serve.app(str(folder), device="cpu", kernels="torch", auto_truncate=True)) as client:
        for name in ("query", "document"):
            openai = client.post("/v1/embeddings", json={"input": real, "prompt_name": name}).json()
            got = np.array([d["embedding"] for d in openai["data"]], dtype=np.float32)
            assert np.abs(got - want[name]).max() <= 1e-5, (family, name)
            tei = np.array(client.post("/embed", json={"inputs": real, "prompt_name": name}).json())
            assert np.abs(tei - want[name]).max() <= 1e-5, (family, name)
        unprompted = np.array(client.post("/embed", json={"inputs": real}).json())
    assert np.abs(unprompted - plain).max() <= 1e-5
    assert np.abs(want["query"] - plain).max() > 1e-3  # the query prompt moves the vectors far past the bar
