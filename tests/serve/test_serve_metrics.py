"""/metrics as text-embeddings-inference 1.9 exposes it, and TEI's response headers, through the ASGI app in this
process (the bundled model's encoder, loaded once; a fresh app per test, so each test's counts are its own). The
model worker can be held at a latch, so that the queue fills while it computes, and made to fail a batch.

TEI's list below is written out from TEI's router and queue (router/src/http/server.rs, router/src/lib.rs,
router/src/prometheus.rs, core/src/infer.rs, core/src/queue.rs at v1.9), not read from fastbert."""
import asyncio
import json
import threading

import pytest
from helpers import optional, real_texts_that_fit

import fastbert

serve = optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")

# What an embedding model's TEI exposes: name -> (Prometheus type, the label its samples carry)
TEI_EMBEDDING_METRICS = {
    # per HTTP request
    "te_request_count": ("counter", "method"),        # method: single (one input) or batch (a list)
    "te_request_success": ("counter", "method"),
    "te_request_failure": ("counter", "err"),
    "te_request_duration": ("histogram", None),       # seconds, arrival to answer
    "te_request_tokenization_duration": ("histogram", None),
    "te_request_queue_duration": ("histogram", None),
    "te_request_inference_duration": ("histogram", None),
    "te_request_input_length": ("histogram", None),   # tokens of each input
    # per input of an embedding request
    "te_embed_count": ("counter", None),
    "te_embed_success": ("counter", None),
    "te_embed_duration": ("histogram", None),
    "te_embed_tokenization_duration": ("histogram", None),
    "te_embed_queue_duration": ("histogram", None),
    "te_embed_inference_duration": ("histogram", None),
    # the queue and the batches it forms
    "te_queue_size": ("gauge", None),
    "te_batch_next_size": ("histogram", None),
    "te_batch_next_tokens": ("histogram", None),
}
# the `err` values TEI gives te_request_failure on the HTTP routes this server has
TEI_FAILURES = {"validation", "batch_size", "tokenization", "model_type", "overloaded", "inference", "dropped"}
# TEI's response headers on an answer with a result: milliseconds, counts, and where it ran
TEI_HEADERS = ("x-compute-type", "x-compute-time", "x-compute-characters", "x-compute-tokens", "x-total-time",
               "x-tokenization-time", "x-queue-time", "x-inference-time")


def tei_duration_bounds():
    """Every *_duration histogram's upper bounds in TEI: 35 of them, the first 1.5e-5 s, each 1.5x the one before."""
    bounds = [1e-5 * 1.5]
    while len(bounds) < 35:
        bounds.append(bounds[-1] * 1.5)
    return bounds


class Held(fastbert.SentenceEncoder):
    """The bundled model, each batch waiting at a latch (open unless a test closes it); `fail` makes it raise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.open, self.entered, self.fail = threading.Event(), threading.Event(), False
        self.open.set()

    def embed_tokenized(self, ids, **kwargs):
        self.entered.set()
        assert self.open.wait(timeout=120), "the test never released the batch"
        if self.fail:
            raise RuntimeError("a fault injected into this batch")
        return super().embed_tokenized(ids, **kwargs)


@pytest.fixture(scope="module")
def encoder(minilm_path):
    return Held.from_pretrained(minilm_path, device="cpu", kernels="torch")


@pytest.fixture(scope="module")
def texts(minilm_path):
    return real_texts_that_fit(minilm_path, 12)


async def call(app, method, path, body=None, gone: asyncio.Event | None = None):
    """One request through the ASGI app -> (status, headers, JSON body or None)."""
    sent, done, messages = False, asyncio.Event(), []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"" if body is None else json.dumps(body).encode(),
                    "more_body": False}
        await (gone.wait() if gone is not None else done.wait())
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    if not messages:
        return None, {}, None
    headers = {k.decode(): v.decode() for k, v in messages[0].get("headers", [])}
    payload = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    is_json = headers.get("content-type", "").startswith("application/json")
    return messages[0]["status"], headers, (json.loads(payload) if payload and is_json else payload.decode())


async def until(condition, timeout=60.0):
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting")


def served(encoder, scenario, **options):
    """scenario(app) run inside a fresh app's lifespan, once the model answers."""
    app = serve.app(encoder, **options)

    async def run():
        async with app.router.lifespan_context(app):
            await until(lambda: app.state.service.ready)
            return await scenario(app)
    encoder.open.set()
    encoder.fail = False
    try:
        return asyncio.run(run())
    finally:
        encoder.open.set()
        encoder.fail = False


def samples(text: str) -> dict:
    """Prometheus text -> {(sample name, labels as text): value}, and the TYPE lines under ("#TYPE", name)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            out[("#TYPE", name)] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            out[(name, labels.rstrip("}"))] = float(value)
    return out


async def metrics_of(app) -> dict:
    return samples((await call(app, "GET", "/metrics"))[2])


def test_names_types_labels_and_buckets_are_teis(encoder, texts):
    async def scenario(app):
        assert (await call(app, "POST", "/embed", {"inputs": texts[:2]}))[0] == 200
        return (await call(app, "GET", "/metrics"))[2]
    text = served(encoder, scenario)
    got = samples(text)
    types = {name: kind for (tag, name), kind in got.items() if tag == "#TYPE"}
    assert types == {name: kind for name, (kind, _) in TEI_EMBEDDING_METRICS.items()}  # no name more, none less
    assert set(serve.metrics.METRICS) - set(types) == {n.replace("embed", "predict", 1) for n in types
                                                       if n.startswith("te_embed_")}  # a scorer's per-input family
    for name, (kind, label) in TEI_EMBEDDING_METRICS.items():
        names = {sample for sample, _ in got if sample != "#TYPE" and (sample == name or sample.startswith(name + "_"))}
        if kind == "histogram":
            assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= names, name
        else:
            assert name in names, name  # the bare name: no _total
        labelled = {labels for sample, labels in got if sample == name and labels}
        assert all(labels.startswith(f'{label}="') for labels in labelled), (name, labelled)
    assert {labels.split('"')[1] for sample, labels in got if sample == "te_request_failure"} == TEI_FAILURES

    def bounds(name):
        return [float(labels.split('"')[1]) for sample, labels in got if sample == f"{name}_bucket"]
    for name in TEI_EMBEDDING_METRICS:
        if name.endswith("duration"):
            assert bounds(name) == tei_duration_bounds() + [float("inf")], name
    assert bounds("te_batch_next_size") == [2.0 ** i for i in range(13)] + [float("inf")]
    assert bounds("te_batch_next_tokens") == [2.0 ** i for i in range(21)] + [float("inf")]
    assert bounds("te_request_input_length") == [2.0 ** i for i in range(9)] + [float("inf")]  # up to the 256 limit
    prometheus = optional("prometheus_client.parser", "prometheus-client is in the serve extra")
    parsed = {family.name: family.type for family in prometheus.text_string_to_metric_families(text)}
    assert parsed == types  # Prometheus' own parser reads every family with its type: none "unknown"


def test_counts_of_successes(encoder, texts, minilm_path):
    import transformers
    tokens = [len(ids) for ids in transformers.AutoTokenizer.from_pretrained(minilm_path)(texts[:7])["input_ids"]]

    async def scenario(app):
        before = await metrics_of(app)
        answers = [await call(app, "POST", "/embed", {"inputs": texts[0]}),
                   await call(app, "POST", "/embed", {"inputs": texts[1:4]}),
                   await call(app, "POST", "/v1/embeddings", {"input": texts[4], "model": "x"}),
                   await call(app, "POST", "/", {"inputs": texts[5:7]})]
        return before, answers, await metrics_of(app)
    before, answers, after = served(encoder, scenario)
    assert [a[0] for a in answers] == [200] * 4

    def delta(name, labels=""):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    assert (delta("te_request_count", 'method="single"'), delta("te_request_count", 'method="batch"')) == (2, 2)
    assert (delta("te_request_success", 'method="single"'), delta("te_request_success", 'method="batch"')) == (2, 2)
    assert sum(delta("te_request_failure", f'err="{err}"') for err in TEI_FAILURES) == 0
    assert delta("te_embed_count") == delta("te_embed_success") == 7
    for stage in ("duration", "tokenization_duration", "queue_duration", "inference_duration"):
        assert delta(f"te_request_{stage}_count") == 4 and delta(f"te_embed_{stage}_count") == 7, stage
    assert delta("te_request_input_length_count") == 7 and delta("te_request_input_length_sum") == sum(tokens)
    assert delta("te_batch_next_size_sum") == 7 and delta("te_batch_next_tokens_sum") == sum(tokens)
    assert delta("te_batch_next_size_count") == 4  # one request at a time: a batch each
    assert after[("te_queue_size", "")] == 0


def test_tei_headers_on_every_answer(encoder, texts, minilm_path):
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path)

    async def scenario(app):
        return [await call(app, "POST", "/embed", {"inputs": texts[:3]}),
                await call(app, "POST", "/v1/embeddings", {"input": texts[3]}),
                await call(app, "POST", "/v1/embeddings", {"input": [tokenizer(texts[4])["input_ids"]]}),
                await call(app, "POST", "/", {"inputs": texts[5]})]
    answers = served(encoder, scenario)
    sent = [texts[:3], [texts[3]], None, [texts[5]]]
    for (status, headers, _), inputs in zip(answers, sent):
        assert status == 200 and set(TEI_HEADERS) <= set(headers), headers
        assert headers["x-compute-type"] == "cpu"
        for name in TEI_HEADERS[1:]:
            assert headers[name].isdigit(), (name, headers[name])  # whole milliseconds and counts
        if inputs is not None:
            assert int(headers["x-compute-characters"]) == sum(len(t) for t in inputs)
            assert int(headers["x-compute-tokens"]) == sum(len(ids) for ids in tokenizer(inputs)["input_ids"])
        assert int(headers["x-total-time"]) >= int(headers["x-inference-time"])
    ids = tokenizer(texts[4])["input_ids"]
    assert answers[2][1]["x-compute-characters"] == answers[2][1]["x-compute-tokens"] == str(len(ids))


def test_queue_size_is_the_queue_while_the_worker_is_held(encoder, texts):
    async def scenario(app):
        scheduler = app.state.service.scheduler
        encoder.open.clear()
        encoder.entered.clear()
        held = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[0]}))
        await until(encoder.entered.is_set)
        waiting = [asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[1:1 + n]})) for n in (1, 3, 4)]
        await until(lambda: scheduler.queued() == 8)
        during = (await metrics_of(app))[("te_queue_size", "")], scheduler.queued()
        encoder.open.set()
        answers = await asyncio.gather(held, *waiting)
        return during, answers, await metrics_of(app)
    (gauge, queued), answers, after = served(encoder, scenario)
    assert gauge == queued == 8 and [a[0] for a in answers] == [200] * 4
    assert after[("te_queue_size", "")] == 0
    assert after[("te_request_queue_duration_count", "")] == 4


async def _overloaded(app, texts, encoder):
    encoder.open.clear()
    encoder.entered.clear()
    held = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[0]}))
    await until(encoder.entered.is_set)
    refused = await call(app, "POST", "/embed", {"inputs": texts[1]})
    encoder.open.set()
    await held
    return refused


async def _inference(app, texts, encoder):
    encoder.fail = True
    return await call(app, "POST", "/embed", {"inputs": texts[:2]})


async def _dropped(app, texts, encoder):
    encoder.open.clear()
    encoder.entered.clear()
    held = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[0]}))
    await until(encoder.entered.is_set)
    gone = asyncio.Event()
    leaving = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[1:3]}, gone=gone))
    await until(lambda: app.state.service.scheduler.queued() == 2)
    gone.set()
    await until(lambda: app.state.service.scheduler.queued() == 0)
    encoder.open.set()
    await held
    return await leaving


def _post(path, body):
    async def send(app, texts, encoder):
        return await call(app, "POST", path, body(texts) if callable(body) else body)
    return send


# err label -> (how to provoke it, the status that shows the fault happened)
FAULTS = {
    "validation": (_post("/embed", {"inputs": []}), 422),
    "batch_size": (_post("/embed", {"inputs": ["a"] * 33}), 413),
    "tokenization": (_post("/embed", lambda texts: {"inputs": " ".join(texts)}), 413),
    "model_type": (_post("/rerank", {"query": "a", "texts": ["b"]}), 404),
    "overloaded": (_overloaded, 429),
    "inference": (_inference, 424),
    "dropped": (_dropped, 499),  # nobody reads it: the client left
}


@pytest.mark.parametrize("err", sorted(FAULTS))
def test_each_failure_label_rises_alone(encoder, texts, err):
    provoke, status = FAULTS[err]

    async def scenario(app):
        before = await metrics_of(app)
        answer = await provoke(app, texts, encoder)
        return before, answer, await metrics_of(app)
    # one request in flight at most: the second, while the first is held, is overloaded
    before, answer, after = served(encoder, scenario, max_concurrent_requests=1 if err == "overloaded" else 8)
    assert answer[0] == status, answer  # the fault happened
    for label in TEI_FAILURES:
        rise = after[("te_request_failure", f'err="{label}"')] - before[("te_request_failure", f'err="{label}"')]
        assert rise == (1 if label == err else 0), (label, rise)
    requests = sum(after.get(("te_request_count", k), 0) - before.get(("te_request_count", k), 0)
                   for k in ('method="single"', 'method="batch"', ""))
    successes = sum(after[("te_request_success", k)] - before[("te_request_success", k)]
                    for k in ('method="single"', 'method="batch"'))
    extra = 1 if err in ("overloaded", "dropped") else 0  # the request held at the latch, answered
    assert requests == 1 + extra and successes == extra  # each request counted once, as a success or a failure
