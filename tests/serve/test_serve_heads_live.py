"""A reranker and a classifier served live by one process: two fastbert.serve apps mounted side by side under one
uvicorn (/reranker, /classifier), each with its own model, worker, queue and metrics (nothing the two share, as
Ray Serve's replicas need). /rerank equals sentence-transformers' CrossEncoder.predict; /predict equals the softmax
of transformers' own logits, under the checkpoint's labels; huggingface_hub's InferenceClient.text_classification
reads the classifier through the root route. Random-weight checkpoints (a BERT cross-encoder with the bundled
model's tokenizer, a DeBERTa-v2 classifier with three named labels), fp32."""
import numpy as np
import pytest
import torch
from helpers import LiveServer, deberta_config, optional, perturb_, real_texts, reranker_folder

httpx = optional("httpx", "httpx is a test extra")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")

LABELS = ("contradiction", "entailment", "neutral")

# Two apps, one process: each app's lifespan (its model loading, its worker) runs inside the parent's.
MOUNTED = """
import contextlib, signal, socket, sys
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount
import fastbert.serve

apps = {name: fastbert.serve.app(folder, device="cpu", auto_truncate=True)
        for name, folder in zip(("reranker", "classifier"), sys.argv[1:3])}

@contextlib.asynccontextmanager
async def lifespan(_):
    async with contextlib.AsyncExitStack() as stack:
        for app in apps.values():
            await stack.enter_async_context(app.router.lifespan_context(app))
        yield

root = Starlette(routes=[Mount("/" + name, app) for name, app in apps.items()], lifespan=lifespan)
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(f"mounted on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn raises the signal again after its clean stop: exit 0
uvicorn.Server(uvicorn.Config(root, log_level="warning")).run(sockets=[sock])
"""


def classifier_folder(minilm_path, root):
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)
    cfg = deberta_config(hidden=64, heads=4, layers=2, intermediate=100, max_len=512, vocab_size=len(tokenizer),
                         num_labels=3, id2label=dict(enumerate(LABELS)),
                         label2id={label: i for i, label in enumerate(LABELS)})
    torch.manual_seed(1)
    folder = root / "classifier"
    perturb_(transformers.DebertaV2ForSequenceClassification(cfg), weight_std=0.05).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(minilm_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return reranker_folder(minilm_path, root), classifier_folder(minilm_path, root)


@pytest.fixture(scope="module")
def server(folders, tmp_path_factory):
    import time
    log = tmp_path_factory.mktemp("server") / "server.log"
    live = LiveServer(["-c", MOUNTED, *folders], log, ready_path="/reranker/health")
    deadline = time.monotonic() + 120
    while httpx.get(live.url + "/classifier/health").status_code != 200:
        assert time.monotonic() < deadline, live.output()
        time.sleep(0.1)
    yield live
    assert live.stop() == 0, live.output()


@pytest.fixture(scope="module")
def texts():
    return real_texts(12, min_chars=20)[:12]


def test_rerank_equals_cross_encoder_predict(server, folders, texts):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    query, passages = texts[0], texts[1:9]
    want = st.CrossEncoder(folders[0], device="cpu").predict([(query, p) for p in passages])
    response = httpx.post(server.url + "/reranker/rerank", json={"query": query, "texts": passages,
                                                                 "return_text": True}, timeout=60)
    assert response.status_code == 200, response.text
    ranks = response.json()
    assert sorted(r["index"] for r in ranks) == list(range(len(passages)))
    assert [r["score"] for r in ranks] == sorted((r["score"] for r in ranks), reverse=True)
    got = np.array([next(r["score"] for r in ranks if r["index"] == i) for i in range(len(passages))])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert all(r["text"] == passages[r["index"]] for r in ranks)
    raw = httpx.post(server.url + "/reranker/rerank", json={"query": query, "texts": passages,
                                                            "raw_scores": True}, timeout=60).json()
    logits = np.array([next(r["score"] for r in raw if r["index"] == i) for i in range(len(passages))])
    np.testing.assert_allclose(1 / (1 + np.exp(-logits)), want, rtol=0, atol=1e-5)  # raw: the logits themselves
    assert httpx.get(server.url + "/reranker/health").status_code == 200


def test_predict_equals_transformers_softmax_with_the_checkpoints_labels(server, folders, texts):
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders[1])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folders[1]).eval()
    pairs = [[texts[i], texts[i + 1]] for i in range(0, 8, 2)]
    cut = dict(padding=True, truncation=True, max_length=512, return_tensors="pt")  # as the server cuts
    with torch.no_grad():
        single = hf(**tokenizer(texts[:8], **cut)).logits.double().softmax(-1)
        paired = hf(**tokenizer([p[0] for p in pairs], [p[1] for p in pairs], **cut)).logits.double().softmax(-1)
    for inputs, want in ((texts[:8], single), (pairs, paired), (texts[0], single[:1]), (pairs[0], paired[:1])):
        response = httpx.post(server.url + "/classifier/predict", json={"inputs": inputs}, timeout=60)
        assert response.status_code == 200, response.text
        got = response.json()
        got = [got] if isinstance(inputs, str) or inputs is pairs[0] else got  # one input: TEI's flat list
        for predictions, row in zip(got, want):
            assert {p["label"]: p["score"] for p in predictions} == pytest.approx(dict(zip(LABELS, row.tolist())),
                                                                                 abs=1e-5)
            assert [p["score"] for p in predictions] == sorted((p["score"] for p in predictions), reverse=True)
    assert httpx.get(server.url + "/classifier/info").json()["model_type"]["classifier"]["id2label"] == \
        {str(i): label for i, label in enumerate(LABELS)}
    assert httpx.post(server.url + "/classifier/rerank", json={"query": "a", "texts": ["b"]}).status_code == 404


def test_inference_client_text_classification(server, folders, texts, monkeypatch):
    import transformers
    hub = optional("huggingface_hub", "huggingface_hub is a dependency of transformers")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)  # offline mode would stop requests to 127.0.0.1
    tokenizer = transformers.AutoTokenizer.from_pretrained(folders[1])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folders[1]).eval()
    with torch.no_grad():
        want = hf(**tokenizer([texts[3]], truncation=True, max_length=512, return_tensors="pt")).logits.double()[0]
    client = hub.InferenceClient(base_url=server.url + "/classifier/")
    got = client.text_classification(texts[3])
    assert {e.label: e.score for e in got} == pytest.approx(dict(zip(LABELS, want.softmax(-1).tolist())), abs=1e-5)
    top = client.text_classification(texts[3], top_k=1, function_to_apply="sigmoid")
    assert len(top) == 1 and top[0].label == LABELS[int(want.argmax())]
    assert top[0].score == pytest.approx(float(torch.sigmoid(want.max())), abs=1e-5)


def test_two_apps_in_one_process_count_apart(server):
    def requests(name):
        text = httpx.get(server.url + f"/{name}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.split(" ")[0].split("{")[0] == "te_request_count")
    before = requests("reranker"), requests("classifier")
    assert httpx.post(server.url + "/reranker/rerank", json={"query": "a", "texts": ["b", "c"]}).status_code == 200
    assert (requests("reranker"), requests("classifier")) == (before[0] + 1, before[1])
