"""`python -m fastbert serve --ray ADDRESS --replicas 2` on a local Ray cluster (2 CPUs, no dashboard) that this
module starts: two CPU replicas of the bundled all-MiniLM-L6-v2 behind Ray Serve's HTTP proxy on 127.0.0.1. One
cluster, one deployment, asserted in order:

- the app's lifespan ran inside each replica under Ray Serve's ingress: /health answers 200 through the proxy as
  soon as the command says the model is ready (a replica counts as started only once its model is loaded);
- openai's SDK and huggingface_hub's InferenceClient get sentence-transformers' vectors through the proxy;
- 16 concurrent clients: every vector is its own text's, and both replicas did the work;
- one replica's actor killed mid-load while both replicas compute (ray.kill on the replica actor, found in Ray
  Serve's namespace as Ray Serve's fault-tolerance guide does it): the requests that replica held are handed to the
  other by the Front deployment, and no request fails; no answer is ever another text's vector; Ray Serve replaces
  the replica; /metrics still answers;
- SIGTERM to the command while requests are in flight: new requests get Ray Serve's 404 at once, each request in
  flight is answered in full, the application is deleted, and the command exits 0.
"""
import os
import random
import signal
import socket
import threading
import time

import numpy as np
import pytest
from helpers import FP32_TOL, LiveServer, max_delta, optional, real_texts_that_fit

from bench import procs

ray = optional("ray", reason="Ray is an optional extra: pip install -e '.[test]'")
serve = optional("ray.serve", reason="Ray Serve comes with the ray extra: pip install -e '.[test]'")
httpx = optional("httpx", "httpx is a test extra")
optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # a local Ray cluster, one worker at a time

KEY = "ray-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "all-MiniLM-L6-v2"
REPLICA = "ray::ServeReplica:fastbert:Server"  # a replica process's title (its cmdline)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module (bench.procs.local_ray_cluster); Ray Serve shut down before it."""
    with procs.local_ray_cluster() as address:
        try:
            yield address
        finally:
            serve.shutdown()


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    """The command, joined to the module's cluster, with the proxy on a free port of 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("server") / "server.log"
    live = LiveServer(["-m", "fastbert", "serve", "--ray", cluster, "--replicas", "2", "--device", "cpu",
                       "--kernels", "torch", "--port", str(port), "--api-key", KEY, "--max-concurrent-requests",
                       "64"], log, timeout=300)
    yield live
    live.stop()  # by its pid; the last test has already stopped it


@pytest.fixture(scope="module")
def corpus(minilm_path):
    """120 real texts of 5..256 tokens."""
    return real_texts_that_fit(minilm_path, 120)


@pytest.fixture(scope="module")
def reference(minilm_path, corpus):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    return st.SentenceTransformer(minilm_path, device="cpu").encode(corpus, batch_size=16)


def replica_names() -> set:
    """The replica actors of the application, by their names in Ray Serve's namespace."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::fastbert#Server#")}


def replica_processes() -> list:
    """The replicas of this module's cluster (ray.init started its raylet from this process, the raylet its workers)."""
    return [pid for pid, line in procs.command_lines().items() if line.startswith(REPLICA) and procs.descends_from(pid)]


def deployment_state():
    application = serve.status().applications.get("fastbert")
    return None if application is None else application.deployments["Server"]


def run_load(url, corpus, plans, clients=16, on_answered=None, retries=3, resent=None):
    """`clients` closed-loop clients send the plans (lists of indices into the corpus) to /embed and /v1/embeddings
    in turn; a 5xx is retried. -> (vectors per plan, [(plan, status, body) of each failed attempt]). resent: a list
    that gets each answer's x-fastbert-retries (the times the Front deployment handed it to another replica)."""
    results, failures, lock = [None] * len(plans), [], threading.Lock()
    order, errors, answered = iter(range(len(plans))), [], [0]

    def client():
        try:
            with httpx.Client(headers=AUTH, timeout=180) as http:
                while True:
                    with lock:
                        i = next(order, None)
                    if i is None:
                        return
                    texts = [corpus[j] for j in plans[i]]
                    for _ in range(retries + 1):
                        if i % 2:
                            response = http.post(url + "/embed", json={"inputs": texts})
                        else:
                            response = http.post(url + "/v1/embeddings", json={"input": texts, "model": NAME,
                                                                               "encoding_format": "float"})
                        if response.status_code < 500:
                            break
                        with lock:
                            failures.append((i, response.status_code, response.text[:300]))
                    assert response.status_code == 200, (i, response.status_code, response.text[:300])
                    if resent is not None and "x-fastbert-retries" in response.headers:
                        with lock:
                            resent.append(int(response.headers["x-fastbert-retries"]))
                    body = response.json()
                    results[i] = np.array(body if i % 2 else [d["embedding"] for d in body["data"]])
                    with lock:
                        answered[0] += 1
                        count = answered[0]
                    if on_answered is not None:
                        on_answered(count)
        except Exception as e:  # noqa: BLE001 - reported below with the others
            errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[:3]
    return results, failures


def assert_own_vectors(results, plans, reference):
    """Every vector is its own text's: within the fp32 bar (max |delta|) of its text's sentence-transformers vector,
    and nearer to it than to any other text's."""
    unit = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    for plan, got in zip(plans, results):
        assert got.shape == (len(plan), 384)
        similarity = (got / np.linalg.norm(got, axis=1, keepdims=True)) @ unit.T
        assert similarity.argmax(axis=1).tolist() == plan
        assert max_delta(got, reference[plan]) <= FP32_TOL


def test_health_and_info_through_the_proxy(server):
    health = [httpx.get(server.url + "/health", timeout=30) for _ in range(6)]  # the router spreads them
    assert [r.status_code for r in health] == [200] * 6
    assert server.health_codes[-1] == 200 and "model ready on" in server.output()
    info = httpx.get(server.url + "/info", headers=AUTH, timeout=30).json()
    assert (info["model_id"], info["device"], info["state"], info["max_concurrent_requests"]) == (NAME, "cpu",
                                                                                                 "ready", 64)
    assert httpx.post(server.url + "/embed", json={"inputs": "a"}).status_code == 401  # the app's gate, per replica
    state = deployment_state()
    assert state.status == "HEALTHY" and state.replica_states == {"RUNNING": 2}
    assert len(replica_names()) == 2 and len(replica_processes()) == 2


def test_openai_sdk_and_inference_client(server, corpus, reference, monkeypatch):
    openai = optional("openai", "openai's SDK is a test extra")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    data = client.embeddings.create(input=corpus[:9], model=NAME).data  # the SDK asks for base64 and decodes it
    got = np.array([d.embedding for d in data])
    assert got.shape == (9, 384) and max_delta(got, reference[:9]) <= FP32_TOL
    hub = optional("huggingface_hub", "huggingface_hub is a dependency of transformers")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)  # offline mode stops requests to 127.0.0.1 too
    got = hub.InferenceClient(base_url=server.url, api_key=KEY).feature_extraction(corpus[10:18])
    assert got.shape == (8, 384) and max_delta(got, reference[10:18]) <= FP32_TOL


def test_concurrent_clients_get_their_own_vectors_from_both_replicas(server, corpus, reference):
    """16 clients, 40 requests of 1..16 texts (340 texts): every vector its own text's, no request failed, and
    both replica processes computed."""
    rng = random.Random(0)
    plans = [rng.sample(range(len(corpus)), rng.randint(1, 16)) for _ in range(40)]
    pids = replica_processes()
    before = {pid: procs.cpu_seconds(pid) for pid in pids}
    results, failures = run_load(server.url, corpus, plans)
    assert failures == []
    assert_own_vectors(results, plans, reference)
    busy = {pid: procs.cpu_seconds(pid) - before[pid] for pid in pids}
    assert len(busy) == 2 and min(busy.values()) > 0.5, busy  # each ran batches, not only its event loop


def test_a_replica_killed_mid_load(server, corpus, reference):
    """16 clients, 64 requests; once 16 are answered and both replica processes are computing (their CPU time rising:
    each holds requests), one replica's actor is killed (no restart of that actor: Ray Serve must start a new
    replica). The Front deployment hands the requests it held to the other replica: no request fails, and some
    were resent; every answer is its own texts' vectors; the deployment is back to 2 running replicas, with a new
    one in place of the killed one; /metrics and /health answer."""
    rng = random.Random(1)
    plans = [rng.sample(range(len(corpus)), rng.randint(1, 16)) for _ in range(64)]
    before = replica_names()
    assert len(before) == 2
    victim = sorted(before)[0]
    killed, resent, one_at_a_time = threading.Event(), [], threading.Lock()

    def both_computing() -> bool:
        pids = replica_processes()
        first = {pid: procs.cpu_seconds(pid) for pid in pids}
        time.sleep(0.2)
        return len(pids) == 2 and all(procs.cpu_seconds(pid) > first[pid] + 0.05 for pid in pids)

    def kill_at(answered):
        if answered < 16 or killed.is_set() or not one_at_a_time.acquire(blocking=False):
            return
        try:
            if not killed.is_set() and both_computing():
                killed.set()
                ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        finally:
            one_at_a_time.release()

    results, failures = run_load(server.url, corpus, plans, on_answered=kill_at, retries=0, resent=resent)
    assert killed.is_set()
    assert failures == []  # no request failed: the dead replica's were resent
    assert len(resent) >= 1 and min(resent) >= 1, resent  # it held requests when it died
    assert_own_vectors(results, plans, reference)
    deadline = time.monotonic() + 180  # a replacement serves ~20 s after the kill here, on a busy machine later
    while True:
        state, names = deployment_state(), replica_names()
        if state.replica_states.get("RUNNING") == 2 and victim not in names and len(names) == 2:
            break
        assert time.monotonic() < deadline, f"not replaced: {state}; replica actors {sorted(names)}"
        time.sleep(0.5)
    assert state.status == "HEALTHY" and len(names & before) == 1  # the survivor, and a new replica
    metrics = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30)
    assert metrics.status_code == 200 and "te_request_count" in metrics.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    again = httpx.post(server.url + "/embed", json={"inputs": corpus[:4]}, headers=AUTH, timeout=60)
    assert max_delta(again.json(), reference[:4]) <= FP32_TOL


def test_sigterm_drains_every_request_in_flight_then_exits_0(server, corpus, reference):
    """Six requests of 32 long texts (the 8 longest, four times: ~8,000 tokens, about a second of one core each) in
    flight, then SIGTERM to the command: the proxies stop routing to the application at once (a new request gets Ray
    Serve's 404), each request in flight is answered in full, the application is deleted, the command exits 0."""
    longest = sorted(range(len(corpus)), key=lambda i: -len(corpus[i]))[:8] * 4
    texts = [corpus[i] for i in longest]
    responses = [None] * 6

    def one(i):
        try:
            responses[i] = httpx.post(server.url + "/embed", json={"inputs": texts}, headers=AUTH, timeout=180)
        except httpx.HTTPError as e:
            responses[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(responses))]
    for t in threads:
        t.start()
    time.sleep(1.0)  # sent and routed: the proxy hands a request to a replica within milliseconds
    assert None in responses  # still in flight (three requests a replica: seconds of work)
    os.kill(server.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while (code := httpx.get(server.url + "/health", timeout=30).status_code) != 404:  # the route is gone at once
        assert code == 200 and time.monotonic() < deadline, code
        time.sleep(0.1)
    refused = httpx.post(server.url + "/embed", json={"inputs": texts[:1]}, headers=AUTH, timeout=30)
    assert refused.status_code == 404  # Ray Serve's answer for a path no application serves
    for t in threads:
        t.join(timeout=300)
    assert [getattr(r, "status_code", r) for r in responses] == [200] * len(responses)
    for response in responses:
        assert max_delta(response.json(), reference[longest]) <= FP32_TOL
    assert server.process.wait(timeout=180) == 0, server.output()
    assert "application deleted" in server.output()
    assert "fastbert" not in serve.status().applications
    assert replica_names() == set()
