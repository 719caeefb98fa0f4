"""The routes beside TEI's /embed and /rerank, each on the same scheduler, each against its sentence-transformers
reference by max |delta|: TEI's /similarity (SentenceTransformer.similarity of encode's vectors) and /embed_all
(encode(output_value="token_embeddings")), Cohere's /v2/embed through the cohere SDK (encode's vectors; the binary
types as quantize_embeddings packs them; output_dimension as encode's truncate_dim), Cohere's /v2/rerank through the
SDK and Jina's /v1/rerank (CrossEncoder.predict), TEI's /embed_sparse (SparseEncoder.encode). One live
`python -m fastbert serve` per kind on 127.0.0.1: the bundled all-MiniLM-L6-v2, a random-weight BERT cross-encoder,
a random-weight BERT SPLADE model."""
import base64

import numpy as np
import pytest
from helpers import LiveServer, optional, real_texts_that_fit, reranker_folder, splade_folder

httpx = optional("httpx", "httpx is a test extra")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")

KEY = "routes-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
# fp32 against sentence-transformers' fp32 (other GEMM shapes): a few 1e-7 on unit vectors and cosines; token
# vectors (no Normalize, components up to ~6) a few 1e-6
FP32_BAR = 1e-5
TOKEN_BAR = 2e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, minilm_path):
    log = tmp_path_factory.mktemp("routes") / "embedder.log"
    live = LiveServer(["-m", "fastbert", "serve", str(minilm_path), "--port", "0", "--api-key", KEY], log,
                      headers=AUTH)
    yield live
    assert live.stop() == 0, live.output()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, minilm_path):
    root = tmp_path_factory.mktemp("routes-reranker")
    folder = reranker_folder(minilm_path, root)
    live = LiveServer(["-m", "fastbert", "serve", folder, "--port", "0", "--api-key", KEY], root / "server.log",
                      headers=AUTH)
    live.folder = folder
    yield live
    assert live.stop() == 0, live.output()


@pytest.fixture(scope="module")
def st_model(minilm_path):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    return st.SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def corpus(minilm_path):
    return real_texts_that_fit(minilm_path, 12)


def max_delta(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max())


def post(server, path, body):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


def test_similarity_equals_sentence_transformers_similarity(embedder, st_model, corpus):
    source, sentences = corpus[0], corpus[1:9]
    response = post(embedder, "/similarity", {"inputs": {"source_sentence": source, "sentences": sentences}})
    assert response.status_code == 200, response.text
    want = st_model.similarity(st_model.encode([source]), st_model.encode(sentences)).numpy()[0]
    assert max_delta(response.json(), want) <= FP32_BAR
    refused = post(embedder, "/similarity", {"inputs": {"source_sentence": source, "sentences": []}})
    assert refused.status_code == 422 and "inputs.sentences" in refused.json()["error"], refused.text


def test_embed_all_equals_token_embeddings(embedder, st_model, corpus):
    texts = corpus[:6]
    response = post(embedder, "/embed_all", {"inputs": texts})
    assert response.status_code == 200, response.text
    got = response.json()
    want = st_model.encode(texts, output_value="token_embeddings")
    assert len(got) == len(texts)
    for row, reference in zip(got, want):
        assert max_delta(row, reference.numpy()) <= TOKEN_BAR
    one = post(embedder, "/embed_all", {"inputs": texts[0]}).json()  # one input: a list of one, as TEI answers
    assert len(one) == 1 and max_delta(one[0], want[0].numpy()) <= TOKEN_BAR


def test_embed_dimensions_equal_sentence_transformers_truncate_dim(embedder, st_model, corpus):
    response = post(embedder, "/embed", {"inputs": corpus[:4], "dimensions": 64})
    assert response.status_code == 200, response.text
    want = st_model.encode(corpus[:4], truncate_dim=64, normalize_embeddings=True)
    assert max_delta(response.json(), want) <= FP32_BAR


def test_cohere_embed_through_the_sdk(embedder, st_model, corpus):
    cohere = optional("cohere", "cohere's SDK is a test extra")
    from sentence_transformers.util.quantization import quantize_embeddings
    client = cohere.ClientV2(api_key=KEY, base_url=embedder.url)
    answer = client.embed(model="embed-v4.0", texts=corpus[:5], input_type="search_document",
                          embedding_types=["float", "base64", "ubinary", "binary"])
    want = st_model.encode(corpus[:5])
    assert max_delta(answer.embeddings.float_, want) <= FP32_BAR
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in answer.embeddings.base64]
    assert max_delta(decoded, want) <= FP32_BAR
    assert answer.embeddings.ubinary == quantize_embeddings(want, precision="ubinary").tolist()
    assert answer.embeddings.binary == quantize_embeddings(want, precision="binary").tolist()
    assert answer.texts == corpus[:5] and answer.meta.api_version.version == "2"
    assert answer.meta.billed_units.input_tokens == sum(len(x) for x in st_model.tokenizer(corpus[:5])["input_ids"])
    cut = client.embed(model="x", texts=corpus[5:8], input_type="search_query", embedding_types=["float"],
                       output_dimension=128)
    assert max_delta(cut.embeddings.float_, st_model.encode(corpus[5:8], truncate_dim=128,
                                                            normalize_embeddings=True)) <= FP32_BAR


def test_cohere_embed_truncation(embedder, st_model):
    cohere = optional("cohere", "cohere's SDK is a test extra")
    client = cohere.ClientV2(api_key=KEY, base_url=embedder.url)
    long = " ".join(["the tide came in over the flats and the birds rose"] * 40)  # past 256 tokens
    with pytest.raises(cohere.core.api_error.ApiError) as refused:
        client.embed(model="x", texts=[long], input_type="search_document", embedding_types=["float"],
                     truncate="NONE")
    assert refused.value.status_code == 413 and "more than the model's limit of 256" in refused.value.body["message"]
    answer = client.embed(model="x", texts=[long], input_type="search_document", embedding_types=["float"],
                          truncate="END")
    assert max_delta(answer.embeddings.float_, st_model.encode([long])) <= FP32_BAR  # sentence-transformers cuts


def test_cohere_rerank_through_the_sdk(reranker, corpus):
    cohere = optional("cohere", "cohere's SDK is a test extra")
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    query, documents = corpus[0], corpus[1:9]
    want = st.CrossEncoder(reranker.folder, device="cpu").predict([(query, d) for d in documents])
    client = cohere.ClientV2(api_key=KEY, base_url=reranker.url)
    answer = client.rerank(model="rerank-v3.5", query=query, documents=documents)
    assert sorted(r.index for r in answer.results) == list(range(len(documents)))
    scores = [r.relevance_score for r in answer.results]
    assert scores == sorted(scores, reverse=True)
    got = np.array([next(r.relevance_score for r in answer.results if r.index == i) for i in range(len(documents))])
    assert max_delta(got, want) <= FP32_BAR
    top = client.rerank(model="rerank-v3.5", query=query, documents=documents, top_n=3)
    assert [r.index for r in top.results] == list(np.argsort(-want, kind="stable")[:3])


def test_jina_rerank(reranker, corpus):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    query, documents = corpus[2], corpus[3:10]
    want = st.CrossEncoder(reranker.folder, device="cpu").predict([(query, d) for d in documents])
    body = {"model": "jina-reranker-v2-base-multilingual", "query": query,
            "documents": documents[:3] + [{"text": d} for d in documents[3:]], "top_n": 5}
    response = post(reranker, "/v1/rerank", body)
    assert response.status_code == 200, response.text
    answer = response.json()
    order = list(np.argsort(-want, kind="stable")[:5])
    assert [r["index"] for r in answer["results"]] == order
    assert max_delta([r["relevance_score"] for r in answer["results"]], want[order]) <= FP32_BAR
    assert all(r["document"]["text"] == documents[r["index"]] for r in answer["results"])
    assert answer["usage"]["total_tokens"] > 0
    bare = post(reranker, "/v1/rerank", {"query": query, "documents": documents, "return_documents": False}).json()
    assert all("document" not in r for r in bare["results"])
    refused = post(reranker, "/v1/rerank", {"query": query, "documents": []})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "documents", refused.text


@pytest.fixture(scope="module")
def sparse(tmp_path_factory, minilm_path):
    optional("sentence_transformers", "sentence-transformers is a test extra")
    root = tmp_path_factory.mktemp("routes-sparse")
    folder = splade_folder(minilm_path, root)
    live = LiveServer(["-m", "fastbert", "serve", folder, "--port", "0", "--api-key", KEY], root / "server.log",
                      headers=AUTH)
    live.folder = folder
    yield live
    assert live.stop() == 0, live.output()


def test_embed_sparse_equals_sparse_encoder_encode(sparse, corpus):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    encoder = st.SparseEncoder(sparse.folder, device="cpu")
    texts = corpus[:6]
    want = encoder.encode(texts, convert_to_tensor=True).to_dense().numpy()
    response = post(sparse, "/embed_sparse", {"inputs": texts})
    assert response.status_code == 200, response.text
    got = np.zeros_like(want)
    for row, weights in enumerate(response.json()):
        index = [w["index"] for w in weights]
        assert index == sorted(index) and len(index) == np.count_nonzero(want[row])  # the same non-zeros, by index
        got[row, index] = [w["value"] for w in weights]
    assert max_delta(got, want) <= FP32_BAR
    info = httpx.get(sparse.url + "/info", headers=AUTH).json()
    assert info["model_type"] == {"embedding": {"pooling": "splade"}}
    assert post(sparse, "/embed", {"inputs": "a"}).status_code == 404  # a dense route: not this kind's
