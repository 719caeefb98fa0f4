"""A live `python -m fastbert serve` that takes at most 2 requests in flight: the next ones are refused at once with
429 (TEI's body on TEI's routes, OpenAI's on /v1, where openai's SDK raises RateLimitError), never queued, and the
server answers /health after; then SIGTERM while requests are in flight: each accepted request is answered in full,
no new connection is taken, and the process exits 0. In this process, the command's server with its model held: on
the stop signal /health turns 503 and a new connection is refused while the accepted requests are unanswered."""
import os
import signal
import threading
import time
import types

import pytest
from helpers import FP32_TOL, LiveServer, max_delta, optional, real_texts

httpx = optional("httpx", "httpx is a test extra")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")


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
            assert max_delta(response.json(), reference) <= FP32_TOL
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
        assert max_delta(response.json(), reference) <= FP32_TOL
    assert server.process.wait(timeout=120) == 0, server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
    assert "Finished server process" in server.output()


class _Held:
    """A SentenceEncoder whose batches wait at a latch (open unless the test closes it)."""

    def __init__(self, encoder):
        self.encoder, self.open, self.entered = encoder, threading.Event(), threading.Event()
        self.open.set()

    def __getattr__(self, name):
        return getattr(self.encoder, name)

    def embed_tokenized(self, ids, **kwargs):
        self.entered.set()
        assert self.open.wait(timeout=300), "the test never released the batch"
        return self.encoder.embed_tokenized(ids, **kwargs)


def _asgi_get(app, path):
    """GET `path` through the ASGI app itself, beside the server (no connection needed) -> (status, body)."""
    import asyncio
    messages = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        messages.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    return messages[0]["status"], b"".join(m.get("body", b"") for m in messages[1:])


def test_sigterm_refuses_new_connections_and_turns_health_503_while_accepted_requests_drain(minilm_path, texts,
                                                                                           reference):
    """The command's uvicorn server (fastbert/cli/serve.py) in this process, its model held at a latch with two
    requests accepted: on the stop signal, /health answers 503 and a new connection is refused while both are still
    unanswered; released, both are answered with their vectors and the server ends."""
    import json
    import socket

    import uvicorn

    import fastbert
    import fastbert.serve
    from fastbert.cli.serve import _server
    encoder = fastbert.SentenceEncoder.from_pretrained(minilm_path, device="cpu", kernels="torch")
    app = fastbert.serve.app(encoder, auto_truncate=True)
    service = app.state.service
    held = service._encoder = _Held(encoder)  # the model the worker loads: behind the latch
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = _server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=None),
                     service)
    runner = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    runner.start()
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.05)
    held.open.clear()
    held.entered.clear()
    threads, responses = fire(types.SimpleNamespace(url=url), 2, {"inputs": texts, "truncate": True})
    deadline = time.monotonic() + 120
    while service.in_flight < 2 or not held.entered.is_set():  # both accepted, the worker holds a batch
        assert time.monotonic() < deadline, (service.in_flight, held.entered.is_set())
        time.sleep(0.01)
    server.handle_exit(signal.SIGTERM, None)
    status, body = _asgi_get(app, "/health")
    assert status == 503 and json.loads(body)["error"] == "the server is shutting down", body
    deadline = time.monotonic() + 60
    while True:  # uvicorn closes its listening socket on the next tick of its loop
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except (ConnectionRefusedError, ConnectionResetError):  # reset: it reached the backlog as the socket closed
            break
        assert time.monotonic() < deadline, "a new connection was still taken"
        time.sleep(0.01)
    assert responses == [None, None]  # both still unanswered: the model is held
    held.open.set()
    for t in threads:
        t.join(timeout=300)
    runner.join(timeout=120)
    assert not runner.is_alive()
    assert [r.status_code for r in responses] == [200, 200]
    for response in responses:
        assert max_delta(response.json(), reference) <= FP32_TOL
