"""Jina-Embeddings-v3's task adapters chosen per request: a folder laid out as the Hub ships jina-embeddings-v3
(random weights, shrunk, the adapters and the tasks' prompts), served through the ASGI app in this process. Requests
naming different tasks are in flight at once, so the scheduler batches their texts together; each vector must be
sentence-transformers' own over transformers' JinaEmbeddingsV3Model holding that task's merged weights (W + s B_t
A_t), encoding with the task's prompt. fp32, CPU, the PyTorch path."""
import threading

import numpy as np
import pytest
from helpers import JINA_PROMPTS, JINA_TASKS, has_rotary_post_norm, jina_task_references, optional, serving

pytestmark = pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no Jina-v3 (5.24+)")

TEXTS = ["A man is eating food.", "Two dogs are playing in the snow while children build a snowman.", "Hi",
         "The quick brown fox jumps over the lazy dog, again and again."]


@pytest.fixture(scope="module")
def jina(tmp_path_factory, minilm_path):
    """(the folder, {task: sentence-transformers over the task's merged weights})."""
    folder, references, _ = jina_task_references(tmp_path_factory.mktemp("jina"), minilm_path)
    return str(folder), references


def test_requests_of_different_tasks_in_flight_at_once(jina):
    serve = optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")
    folder, references = jina
    tasks = [*JINA_TASKS, None] * 2
    results = [None] * len(tasks)
    with serving(serve.app(folder, device="cpu", kernels="torch")) as client:
        assert client.get("/info").json()["tasks"] == list(JINA_TASKS)
        start = threading.Barrier(len(tasks))

        def post(i, task):
            body = {"input": TEXTS} if task is None else {"input": TEXTS, "task": task}
            start.wait()
            results[i] = client.post("/v1/embeddings", json=body)

        threads = [threading.Thread(target=post, args=(i, task)) for i, task in enumerate(tasks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        tei = client.post("/embed", json={"inputs": TEXTS[:2], "task": "retrieval.passage"})
        unknown = client.post("/embed", json={"inputs": TEXTS, "task": "query"})
    for task, response in zip(tasks, results):
        assert response.status_code == 200, response.text
        got = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
        want = references[task].encode(TEXTS, prompt=JINA_PROMPTS[task] if task else None)
        assert np.abs(got - want).max() <= 1e-5, task
    want = references["retrieval.passage"].encode(TEXTS[:2], prompt=JINA_PROMPTS["retrieval.passage"])
    assert np.abs(np.array(tei.json(), dtype=np.float32) - want).max() <= 1e-5
    assert unknown.status_code == 422 and "'query' is not one of this model's tasks" in unknown.text
