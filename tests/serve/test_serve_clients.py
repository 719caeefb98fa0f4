"""The clients teams point at an embedding server, each talking to one live `python -m fastbert serve` (the bundled
all-MiniLM-L6-v2 given by its folder's path, an API key) on 127.0.0.1, shared by the module: LangChain's
OpenAIEmbeddings with its own default model name, openai's SDK naming a model of its own, LlamaIndex's
OpenAILikeEmbedding, Haystack's OpenAIDocumentEmbedder and huggingface_hub's InferenceClient. Every vector is
compared with SentenceTransformer.encode of its own text by max |delta| at the fp32 bar. Also here, without a
server: the names folders are served under."""
import os
import shutil

import numpy as np
import pytest
from helpers import LiveServer, optional, real_texts_that_fit, serving

KEY = "clients-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "all-MiniLM-L6-v2"
# fp32: fastbert's unit vectors against sentence-transformers' (both fp32, different GEMM shapes) differ by a few
# 1e-7 per component; the project's fp32 bar
FP32_BAR = 1e-5

httpx = optional("httpx", "httpx is a test extra")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")


@pytest.fixture(scope="module")
def server(tmp_path_factory, minilm_path):
    log = tmp_path_factory.mktemp("clients") / "server.log"
    live = LiveServer(["-m", "fastbert", "serve", str(minilm_path), "--port", "0", "--api-key", KEY], log)
    yield live
    code = live.stop()
    assert code == 0, live.output()


@pytest.fixture(scope="module")
def corpus(minilm_path):
    return real_texts_that_fit(minilm_path, 24)


@pytest.fixture(scope="module")
def reference(minilm_path, corpus):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    return st.SentenceTransformer(str(minilm_path), device="cpu").encode(corpus, batch_size=8)


def assert_vectors(got, want):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    delta = np.abs(got - want).max()
    assert delta <= FP32_BAR, f"max |delta| {delta:.3g} from sentence-transformers > {FP32_BAR}"


# ---- names -----------------------------------------------------------------------------------------------------------
def _small_copy(minilm_path, folder):
    """The bundled folder's files but its weights (the name is read before any weight loads)."""
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return str(folder)


def _served(folder, **options):
    import fastbert.serve
    return fastbert.serve.app(folder, device="cpu", **options).state.service.name


def test_served_names(minilm_path, tmp_path):
    assert os.path.basename(os.path.normpath(minilm_path)) == "model"  # the package's folder: named "model"
    assert _served(None) == NAME and _served(str(minilm_path)) == NAME
    assert _served(_small_copy(minilm_path, tmp_path / "renamed-copy")) == NAME  # its model card names it
    snapshot = tmp_path / "hub" / "models--acme--bert-retriever" / "snapshots" / "0123abcd"
    plain = _small_copy(minilm_path, snapshot)
    os.remove(os.path.join(plain, "README.md"))
    assert _served(plain) == "acme/bert-retriever"  # a Hub cache's snapshot: its repo id
    other = _small_copy(minilm_path, tmp_path / "my-retriever")
    os.remove(os.path.join(other, "README.md"))
    assert _served(other) == "my-retriever"  # no card: the folder's name
    with open(os.path.join(other, "README.md"), "w") as f:  # a card whose title is a sentence names nothing
        f.write("---\nlibrary_name: sentence-transformers\n---\n\n# SentenceTransformer based on x/y\n")
    assert _served(other) == "my-retriever"
    assert _served(str(minilm_path), served_model_name="prod-embedder") == "prod-embedder"


# ---- clients ---------------------------------------------------------------------------------------------------------
def test_models_list_and_any_model_name(server, corpus, reference):
    openai = optional("openai", "openai's SDK is a test extra")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    for model in ("text-embedding-3-small", NAME, "anything-at-all"):  # one model served: any name is answered
        answer = client.embeddings.create(input=corpus[:3], model=model, encoding_format="float")
        assert answer.model == NAME  # the served name, as TEI answers
        assert_vectors([d.embedding for d in answer.data], reference[:3])
    default = client.embeddings.create(input=corpus[3:5], model="text-embedding-3-small")  # the SDK's base64
    assert_vectors([d.embedding for d in default.data], reference[3:5])


def test_langchain_openai_embeddings_default_model(server, corpus, reference):
    lc = optional("langchain_openai", "langchain-openai is a test extra")
    embeddings = lc.OpenAIEmbeddings(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                                     # LangChain tokenizes with OpenAI's tiktoken and sends those token ids unless
                                     # told not to; any server but OpenAI's must get the texts
                                     check_embedding_ctx_length=False)
    assert embeddings.model == "text-embedding-ada-002"  # its own default, sent as is
    assert_vectors(embeddings.embed_documents(corpus[:6]), reference[:6])
    assert_vectors([embeddings.embed_query(corpus[6])], reference[6:7])


def test_llama_index_openai_like_embedding(server, corpus, reference):
    llama = optional("llama_index.embeddings.openai_like", "llama-index-embeddings-openai-like is a test extra")
    embedder = llama.OpenAILikeEmbedding(model_name="some-embedder", api_base=server.url + "/v1", api_key=KEY,
                                         embed_batch_size=4, max_retries=0)
    assert_vectors(embedder.get_text_embedding_batch(corpus[7:13]), reference[7:13])
    assert_vectors([embedder.get_query_embedding(corpus[13])], reference[13:14])


def test_haystack_openai_document_embedder(server, corpus, reference):
    haystack = optional("haystack", "haystack-ai is a test extra")
    from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder
    from haystack.utils import Secret
    documents = [haystack.Document(content=text) for text in corpus[14:20]]
    embedder = OpenAIDocumentEmbedder(api_key=Secret.from_token(KEY), api_base_url=server.url + "/v1",
                                      batch_size=4, progress_bar=False)
    embedded = embedder.run(documents=documents)["documents"]
    assert_vectors([d.embedding for d in embedded], reference[14:20])
    text = OpenAITextEmbedder(api_key=Secret.from_token(KEY), api_base_url=server.url + "/v1").run(text=corpus[20])
    assert_vectors([text["embedding"]], reference[20:21])


def test_huggingface_hub_feature_extraction(server, corpus, reference, monkeypatch):
    hub = optional("huggingface_hub", "huggingface_hub is a dependency of transformers")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)  # offline mode stops requests to 127.0.0.1 too
    client = hub.InferenceClient(base_url=server.url, api_key=KEY)
    assert_vectors(client.feature_extraction(corpus[20:24]), reference[20:24])
    assert_vectors(client.feature_extraction(corpus[21]), reference[21:22])


def test_strict_model_name_refuses_other_names(minilm_path, corpus, reference):
    import fastbert.serve
    with serving(fastbert.serve.app(str(minilm_path), device="cpu", kernels="torch",
                                       strict_model_name=True)) as client:
        refused = client.post("/v1/embeddings", json={"input": "a", "model": "text-embedding-ada-002"})
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
        assert "'text-embedding-ada-002' is not served here" in refused.json()["error"]["message"]
        for model in (NAME, str(minilm_path), None):  # the served name, the folder as given, or none
            answer = client.post("/v1/embeddings", json={"input": corpus[:2], "model": model})
            assert answer.status_code == 200, answer.text
            assert_vectors([d["embedding"] for d in answer.json()["data"]], reference[:2])
