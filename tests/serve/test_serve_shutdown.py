"""A live `python -m fastbert serve` that takes at most 2 requests in flight: the next ones are refused at once with
429 (TEI's body on TEI's routes, OpenAI's on /v1, where openai's SDK raises RateLimitError), never queued, and the
server answers /health after; then SIGTERM while requests are in flight: each accepted request is answered in full,
no new connection is taken, and the process exits 0."""
import os
import signal
import threading
import time

import pytest
from helpers import LiveServer, cosines, optional, real_texts

httpx = optional("httpx", "httpx is a test extra")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn, prometheus-client) is a test extra")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    live = LiveServer(["-m", "fastbert", "serve", "--port", "0", "--max-concurrent-requests", "2"], log)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def texts():
    return real_texts(32)


@pytest.fixture(scope="module")
def reference(minilm_path, texts):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    return st.SentenceTransformer(minilm_path, device="cpu").encode(texts)


def counted(server, name) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def in_flight(server) -> float:
    return counted(server, "te_request_count") - counted(server, "te_request_success") - counted(
        server, "te_request_failure")


def fire(server, count, body, path="/embed"):
    """`count` requests at the same moment, each on its own connection -> their responses (or exceptions)."""
    barrier, responses = threading.Barrier(count), [None] * count

    def one(i):
        barrier.wait()
        try:
            responses[i] = httpx.post(server.url + path, json=body, timeout=300)
        except httpx.HTTPError as e:
            responses[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, responses


def test_past_the_limit_in_flight_a_request_is_refused_at_once(server, texts, reference):
    body = {"inputs": texts, "truncate": True}
    threads, responses = fire(server, 10, body)
    for t in threads:
        t.join(timeout=300)
    statuses = sorted(r.status_code for r in responses)
    assert 429 in statuses and 200 in statuses and set(statuses) == {200, 429}, statuses
    for response in responses:
        if response.status_code == 429:
            assert response.json() == {"error": "the server is at its limit of 2 requests in flight; retry later",
                                       "error_type": "Overloaded"}
        else:
            assert cosines(response.json(), reference).min() >= 0.99999
    openai = optional("openai", "openai's SDK is a test extra")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    threads, _ = fire(server, 2, body)  # two in flight (the limit) ...
    deadline = time.monotonic() + 60
    while in_flight(server) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(openai.RateLimitError, match="at its limit of 2 requests in flight"):
        client.embeddings.create(input=texts, model="all-MiniLM-L6-v2")  # ... the third is refused
    for t in threads:
        t.join(timeout=300)
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_answers_every_accepted_request_then_exits_0(server, texts, reference):
    threads, responses = fire(server, 2, {"inputs": texts, "truncate": True})
    deadline = time.monotonic() + 60
    while in_flight(server) < 2:  # both accepted
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(server.process.pid, signal.SIGTERM)
    for t in threads:
        t.join(timeout=300)
    assert [r.status_code for r in responses] == [200, 200]
    for response in responses:
        assert cosines(response.json(), reference).min() >= 0.99999
    assert server.process.wait(timeout=120) == 0, server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
    assert "Finished server process" in server.output()
