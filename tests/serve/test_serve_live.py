"""`python -m fastbert serve` (the bundled all-MiniLM-L6-v2, an API key) as a live process on 127.0.0.1, one for this
module, talked to by clients nobody here wrote: openai's SDK (embeddings.create, float and base64) and
huggingface_hub's InferenceClient (feature_extraction), and by plain HTTP for TEI's routes. Every vector is compared
with SentenceTransformer.encode of its own text (max |delta| <= 1e-5); under concurrent load (32 clients, requests of
1..16 real texts) every vector must be its own text's. Bad input, a missing or wrong key and a body past the payload
limit get their status and a message naming the field, and the server answers /health after each."""
import base64
import json
import random
import threading

import numpy as np
import pytest
from helpers import FP32_TOL, LiveServer, cosines, max_delta, optional, real_texts_that_fit

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "all-MiniLM-L6-v2"

httpx = optional("httpx", "httpx is a test extra")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    live = LiveServer(["-m", "fastbert", "serve", "--port", "0", "--api-key", KEY, "--max-concurrent-requests",
                       "64"], log)
    yield live
    code = live.stop()
    assert code == 0, live.output()


@pytest.fixture(scope="module")
def corpus(minilm_path):
    """80 real texts of 5..256 tokens (a longer one is a 413 unless the request asks to truncate it)."""
    return real_texts_that_fit(minilm_path, 80)


@pytest.fixture(scope="module")
def reference(minilm_path, corpus):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    return st.SentenceTransformer(minilm_path, device="cpu").encode(corpus, batch_size=16)


def assert_healthy(server):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def metric(server, name) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)


def test_openai_sdk_float_and_base64(server, corpus, reference, minilm_path):
    openai = optional("openai", "openai's SDK is a test extra")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    texts, want = corpus[:9], reference[:9]
    as_float = client.embeddings.create(input=texts, model=NAME, encoding_format="float")
    as_base64 = client.embeddings.create(input=texts, model=NAME, encoding_format="base64")
    sdk_default = client.embeddings.create(input=texts, model=NAME)  # the SDK asks for base64 and decodes it
    got_float = np.array([d.embedding for d in as_float.data])
    got_base64 = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in as_base64.data])
    got_default = np.array([d.embedding for d in sdk_default.data])
    for got in (got_float, got_base64, got_default):
        assert got.shape == want.shape and max_delta(got, want) <= FP32_TOL
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-6)  # the model's Normalize
    np.testing.assert_array_equal(got_base64, got_float.astype(np.float32))  # the same float32s, two encodings
    assert [d.index for d in as_float.data] == list(range(9)) and as_float.model == NAME
    import transformers
    tokens = sum(len(ids) for ids in transformers.AutoTokenizer.from_pretrained(minilm_path)(
        texts, truncation=True, max_length=256)["input_ids"])
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == tokens
    one = client.embeddings.create(input=corpus[20], model=NAME, encoding_format="float")
    assert max_delta([one.data[0].embedding], reference[20:21]) <= FP32_TOL
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    other = client.embeddings.create(input=corpus[20], model="text-embedding-3-small", encoding_format="float")
    assert other.model == NAME and other.data[0].embedding == one.data[0].embedding  # any name: the one model
    assert_healthy(server)


def test_huggingface_hub_inference_client(server, corpus, reference, monkeypatch, minilm_path):
    hub = optional("huggingface_hub", "huggingface_hub is a dependency of transformers")
    # offline mode (no model hub here) stops every request the client makes, to 127.0.0.1 too
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    client = hub.InferenceClient(base_url=server.url, api_key=KEY)
    got = client.feature_extraction(corpus[10:18])
    assert got.shape == (8, 384) and max_delta(got, reference[10:18]) <= FP32_TOL
    single = client.feature_extraction(corpus[30])
    assert single.shape == (1, 384) and max_delta(single, reference[30:31]) <= FP32_TOL
    cut = client.feature_extraction(corpus[10:12], dimensions=64, normalize=True)
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    truncated = st.SentenceTransformer(minilm_path, device="cpu", truncate_dim=64)  # its own truncation
    assert max_delta(cut, truncated.encode(corpus[10:12], normalize_embeddings=True)) <= FP32_TOL
    assert_healthy(server)


def test_tei_routes(server, corpus, reference, minilm_path):
    post = lambda path, body: httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)  # noqa: E731
    raw = post("/embed", {"inputs": corpus[:4], "normalize": False})
    assert raw.status_code == 200
    raw = np.array(raw.json())
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    model = st.SentenceTransformer(minilm_path, device="cpu")
    pooled = st.SentenceTransformer(modules=[model[0], model[1]], device="cpu")  # before its Normalize
    assert max_delta(raw, pooled.encode(corpus[:4])) <= FP32_TOL and np.linalg.norm(raw, axis=1).min() > 1.5
    tokens = post("/tokenize", {"inputs": [corpus[0], "Hello, world!"]}).json()
    assert [t["text"] for t in tokens[1]] == ["[CLS]", "Hello", ",", "world", "!", "[SEP]"]  # the input's own text
    assert [t["id"] for t in tokens[1]] == [101, 7592, 1010, 2088, 999, 102]
    assert [(t["start"], t["stop"]) for t in tokens[1]] == [(None, None), (0, 5), (5, 6), (7, 12), (12, 13),
                                                            (None, None)]
    ids = [t["id"] for t in tokens[0]][:256]
    by_ids = post("/v1/embeddings", {"input": [ids[:-1] + [102] if len(ids) == 256 else ids],
                                     "encoding_format": "float"}).json()
    assert max_delta([by_ids["data"][0]["embedding"]], reference[:1]) <= FP32_TOL  # token ids: the same vector
    info = httpx.get(server.url + "/info", headers=AUTH).json()
    assert info["model_id"] == NAME and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert (info["max_input_length"], info["max_batch_tokens"], info["max_client_batch_size"],
            info["max_concurrent_requests"]) == (256, 16384, 32, 64)
    truncated = post("/embed", {"inputs": " ".join(corpus) , "truncate": True})
    assert truncated.status_code == 200 and len(truncated.json()[0]) == 384
    left = post("/embed", {"inputs": " ".join(corpus), "truncate": True, "truncation_direction": "left"})
    assert cosines(truncated.json(), left.json())[0] < 0.99  # the other end of the text
    assert_healthy(server)


LONG = "word " * 300
# (route, body (a JSON value, or bytes sent as they are), status, the start of the message)
BAD = [
    ("/embed", b'{"inputs": ["a",', 422, "body: not valid JSON"),
    ("/embed", b"[1, 2]", 422, "body: expected a JSON object, got a list"),
    ("/embed", {"input": "a"}, 422, "inputs: Field required"),
    ("/embed", {"inputs": 3}, 422, "inputs: must be a string, a list of strings or token ids, got int"),
    ("/embed", {"inputs": []}, 422, "inputs: is an empty list"),
    ("/embed", {"inputs": ["a", None]}, 422, "inputs[1] must be a string or a list of token ids"),
    ("/embed", {"inputs": "a", "normalize": "yes"}, 422, "normalize: Input should be a valid boolean"),
    ("/embed", {"inputs": "a", "dimensions": 0}, 422, "dimensions: Input should be greater than or equal to 1"),
    ("/embed", {"inputs": "a", "dimensions": 385}, 422, "dimensions: 385 is more than the model's 384"),
    ("/embed", {"inputs": "a", "prompt_name": "nope"}, 422, "prompt_name: prompt_name 'nope' is not one of"),
    ("/embed", {"inputs": "a", "task": "retrieval.query"}, 422, "task: 'retrieval.query' names a task adapter"),
    ("/embed", {"inputs": "a", "truncation_direction": "middle"}, 422, "truncation_direction: Input should be"),
    ("/embed", {"inputs": [[5, 999999]]}, 422, "inputs: token id 999999 is outside the vocabulary"),
    ("/embed", {"inputs": ["a"] * 33}, 413, "inputs: 33 inputs, more than the limit of 32 per request"),
    ("/embed", {"inputs": ["a", LONG]}, 413, "inputs[1] has 302 tokens, more than the model's limit of 256"),
    ("/v1/embeddings", {"input": LONG}, 413, "input has 302 tokens, more than the model's limit of 256"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 422, "encoding_format: Input should be"),
    ("/v1/embeddings", {"model": NAME}, 422, "input: Field required"),
    ("/rerank", {"query": "a", "texts": ["b"]}, 404, "no route POST /rerank for this embedding model"),
]


@pytest.mark.parametrize("path, body, status, message", BAD, ids=[f"{b[0]}-{b[3][:30]}" for b in BAD])
def test_bad_input_gets_its_status_and_a_message_naming_the_field(server, path, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    if path.startswith("/v1"):  # OpenAI's error shape
        assert error["error"]["message"].startswith(message), error
        assert error["error"]["type"] in ("invalid_request_error", "not_found_error")
    else:  # TEI's
        assert error["error"].startswith(message), error
        assert error["error_type"] == ("NotFound" if status == 404 else "Validation")
    assert_healthy(server)


def test_payload_limit_declared_or_streamed(server):
    body = json.dumps({"inputs": ["x" * 100_000] * 21}).encode()  # 2.1 MB > the 2,000,000-byte default
    declared = httpx.post(server.url + "/embed", content=body, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=60)
    assert declared.status_code == 413
    assert declared.json()["error"] == f"body: {len(body):,} bytes, more than the payload limit of 2,000,000 bytes"
    streamed = httpx.post(server.url + "/embed", content=iter([body[i:i + 65536] for i in range(0, len(body),
                                                                                                 65536)]),
                          headers={**AUTH, "Content-Type": "application/json"}, timeout=60)  # chunked: no length
    assert streamed.status_code == 413
    assert streamed.json()["error"] == "body: more than the payload limit of 2,000,000 bytes"
    assert_healthy(server)


def test_api_key(server):
    url = server.url
    assert httpx.post(url + "/embed", json={"inputs": "a"}).status_code == 401
    wrong = httpx.post(url + "/embed", json={"inputs": "a"}, headers={"Authorization": "Bearer " + KEY[:-1]})
    assert wrong.status_code == 401 and wrong.json()["error_type"] == "Unauthorized"
    assert wrong.headers["www-authenticate"] == "Bearer" and KEY not in wrong.text
    assert httpx.post(url + "/embed", json={"inputs": "a"}, headers={"Authorization": KEY}).status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401 and httpx.get(url + "/info").status_code == 401
    openai = optional("openai", "openai's SDK is a test extra")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="not-the-key", max_retries=0).embeddings.create(input="a",
                                                                                                   model=NAME)
    assert httpx.post(url + "/embed", json={"inputs": "a"}, headers=AUTH).status_code == 200
    assert_healthy(server)  # /health needs no key: a load balancer's probe holds none
    assert KEY not in server.output()  # the key is never logged


def test_concurrent_clients_each_get_their_own_texts_vectors(server, corpus, reference):
    """32 clients at once, 48 requests of 1..16 texts drawn from 80 real texts of 5..256 tokens, through TEI's
    /embed and openai's SDK: every vector is its own text's (within 1e-5, max |delta|, of its text's reference, and
    nearer to it than to any other text's); the texts were gathered across requests (fewer batches than
    requests)."""
    openai = optional("openai", "openai's SDK is a test extra")
    rng = random.Random(0)
    plans = [rng.sample(range(len(corpus)), rng.randint(1, 16)) for _ in range(48)]
    batches_before, texts_before = metric(server, "te_batch_next_size_count"), metric(server, "te_batch_next_size_sum")
    results, errors = [None] * len(plans), []
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def client(worker):
        try:
            with httpx.Client(headers=AUTH, timeout=120) as http:
                for i in range(worker, len(plans), 32):
                    texts = [corpus[j] for j in plans[i]]
                    if i % 2:
                        results[i] = np.array(http.post(server.url + "/embed", json={"inputs": texts}).json())
                    else:
                        data = sdk.embeddings.create(input=texts, model=NAME).data
                        results[i] = np.array([d.embedding for d in data])
        except Exception as e:  # noqa: BLE001 - reported below with the others
            errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(w,)) for w in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    reference_unit = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    for plan, got in zip(plans, results):
        assert got.shape == (len(plan), 384)
        similarity = (got / np.linalg.norm(got, axis=1, keepdims=True)) @ reference_unit.T
        assert similarity.argmax(axis=1).tolist() == plan
        assert max_delta(got, reference[plan]) <= FP32_TOL
    texts = sum(len(p) for p in plans)
    assert metric(server, "te_batch_next_size_sum") - texts_before == texts  # each text computed once
    assert metric(server, "te_batch_next_size_count") - batches_before < len(plans)
    assert_healthy(server)


def test_metrics_under_tei_names(server):
    # a success and a failure of this test's own (the module's other tests may run in another process)
    assert httpx.post(server.url + "/embed", json={"inputs": "hello"}, headers=AUTH).status_code == 200
    assert httpx.post(server.url + "/embed", json={"inputs": []}, headers=AUTH).status_code == 422
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    for name in ("te_request_count", "te_request_success", "te_request_failure", "te_request_duration_bucket",
                 "te_request_queue_duration_bucket", "te_request_inference_duration_bucket",
                 "te_batch_next_size_bucket", "te_batch_next_tokens_bucket", "te_queue_size"):
        assert any(line.startswith(name + " ") or line.startswith(name + "{") for line in text.splitlines()), name
    assert metric(server, "te_request_failure") > 0 and metric(server, "te_queue_size") == 0
    assert metric(server, "te_request_count") == metric(server, "te_request_success") + metric(
        server, "te_request_failure")
