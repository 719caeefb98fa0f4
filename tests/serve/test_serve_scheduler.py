"""The scheduler and the app's states, in this process, made deterministic by holding the model worker: the bundled
model's encoder with a latch around its real forward (each batch waits until the test releases it, and records the
token ids and tasks it was given), so that the queue can be filled while the worker is busy. Requests go straight
to the ASGI app (its receive and send in the test's hands: a client that disconnects is one whose receive says so).

- texts of requests for different tasks are gathered into one batch, each carrying its own request's task to the one
  encoder call (SentenceEncoder.embed_tokenized(tasks=...)). The bundled model has no task adapters: the latch
  accepts the tasks (with no prompt) and computes the model as loaded, so this proves the serving side (every
  text's task reaches the model with it); a model with real adapters is served in test_serve_jina_tasks.py;
- a client that goes away is dropped from the queue and its texts are never computed;
- /health is 503 while the model loads, after it failed to load, and while draining; a batch that raises is a 424
  for its requests and the next batch runs."""
import asyncio
import json
import threading

import numpy as np
import pytest
from helpers import FP32_TOL, main_in_process, max_delta, optional, real_texts

import fastbert

serve = optional("fastbert.serve", "the serve extra (fastapi, uvicorn) is a test extra")
TASKS = ("retrieval.query", "retrieval.passage")


class Latched(fastbert.SentenceEncoder):
    """The bundled model, each batch held at a latch (open unless a test closes it) and recorded."""

    tasks = TASKS

    def task_prompt(self, task):
        return ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.open, self.entered, self.batches, self.fail = threading.Event(), threading.Event(), [], False
        self.open.set()

    def embed_tokenized(self, ids, *, prompts=None, tasks=None):
        self.batches.append({"ids": [tuple(x) for x in ids], "tasks": list(tasks),
                             "invariant": fastbert.dispatch.invariant()})
        self.entered.set()
        assert self.open.wait(timeout=120), "the test never released the batch"
        if self.fail:
            raise RuntimeError("a fault injected into this batch")
        return super().embed_tokenized(ids, prompts=prompts)


@pytest.fixture(scope="module")
def encoder(minilm_path):
    return Latched.from_pretrained(minilm_path, device="cpu", kernels="torch")


@pytest.fixture(scope="module")
def texts():
    return real_texts(12)


async def call(app, method, path, body=None, gone: asyncio.Event | None = None):
    """One request through the ASGI app -> (status, JSON body or None). gone: the client disconnects when set."""
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
    payload = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return messages[0]["status"], (json.loads(payload) if payload else None)


async def until(condition, timeout=60.0):
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting")


async def ready(app):
    async def healthy():
        return (await call(app, "GET", "/health"))[0] == 200
    for _ in range(6000):
        if await healthy():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the app never became ready")


def reference(minilm_path, texts):
    st = optional("sentence_transformers", "sentence-transformers is a test extra")
    return st.SentenceTransformer(minilm_path, device="cpu").encode(texts)


def test_the_model_worker_runs_every_batch_under_batch_invariant(encoder, texts):
    """The worker thread runs the warm-up and every batch inside fastbert.batch_invariant() (what pins the kernels'
    tiles on a GPU: docs/serve.md); the thread that built the app is outside it."""
    app = serve.app(encoder, auto_truncate=True)

    async def run():
        async with app.router.lifespan_context(app):
            await ready(app)
            start = len(encoder.batches)
            answers = await asyncio.gather(*(call(app, "POST", "/embed", {"inputs": texts[i:i + 3]})
                                             for i in range(0, 9, 3)))
        return start, answers

    start, answers = asyncio.run(run())
    assert [status for status, _ in answers] == [200, 200, 200]
    assert start >= 1 and len(encoder.batches) > start  # the warm-up, then the requests' batches
    assert [b["invariant"] for b in encoder.batches] == [True] * len(encoder.batches)
    assert not fastbert.dispatch.invariant()


def test_texts_of_different_tasks_share_one_batch_each_with_its_own_task(encoder, minilm_path, texts):
    app = serve.app(encoder, auto_truncate=True)  # texts past 256 tokens cut there, as sentence-transformers cuts
    service = app.state.service

    async def run():
        async with app.router.lifespan_context(app):
            await ready(app)
            start = len(encoder.batches)
            encoder.open.clear()
            encoder.entered.clear()
            first = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[0]}))
            await until(encoder.entered.is_set)  # the worker holds this one batch; the next requests queue up
            query = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[1:4], "task": TASKS[0]}))
            passage = asyncio.ensure_future(call(app, "POST", "/v1/embeddings", {"input": texts[4:6],
                                                                                "task": TASKS[1]}))
            plain = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[6]}))
            await until(lambda: service.scheduler.queued() == 6)
            encoder.open.set()
            answers = await asyncio.gather(first, query, passage, plain)
            unknown = await call(app, "POST", "/embed", {"inputs": "a", "task": "summarization"})
            info = await call(app, "GET", "/info")
        return start, answers, unknown, info

    start, (first, query, passage, plain), unknown, info = asyncio.run(run())
    assert [a[0] for a in (first, query, passage, plain)] == [200] * 4
    assert len(encoder.batches) == start + 2  # the held batch, then one for the three requests that queued
    gathered = encoder.batches[start + 1]
    tokenized = encoder.tokenizer(texts[1:7], truncation=True, max_length=256)["input_ids"]
    # the three requests' texts (in the order their tokenizing finished), each with its request's task
    expected = zip(map(tuple, tokenized), [TASKS[0]] * 3 + [TASKS[1]] * 2 + [None])
    assert sorted(zip(gathered["ids"], gathered["tasks"]), key=str) == sorted(expected, key=str)
    want = reference(minilm_path, texts[:7])
    got = np.array(first[1] + query[1] + [d["embedding"] for d in passage[1]["data"]] + plain[1])
    assert max_delta(got, want) <= FP32_TOL  # each vector its own text's, whichever request it came in
    assert unknown[0] == 422 and unknown[1]["error"].startswith("task: 'summarization' is not one of this model's "
                                                                "tasks (retrieval.query, retrieval.passage)")
    assert info[1]["tasks"] == list(TASKS)


def test_a_client_that_goes_away_is_dropped_from_the_queue_never_computed(encoder, texts):
    app = serve.app(encoder, auto_truncate=True)
    service = app.state.service

    async def run():
        async with app.router.lifespan_context(app):
            await ready(app)
            start = len(encoder.batches)
            encoder.open.clear()
            encoder.entered.clear()
            held = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[0]}))
            await until(encoder.entered.is_set)
            gone = asyncio.Event()
            leaving = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[1:5]}, gone=gone))
            await until(lambda: service.scheduler.queued() == 4)
            gone.set()
            await until(lambda: service.scheduler.queued() == 0)  # its texts left the queue at once
            staying = asyncio.ensure_future(call(app, "POST", "/embed", {"inputs": texts[5]}))
            await until(lambda: service.scheduler.queued() == 1)
            encoder.open.set()
            results = await asyncio.gather(held, staying, leaving)
            health = await call(app, "GET", "/health")
            metrics = app.state.service.metrics.exposition().decode()
        return start, results, health, metrics

    start, (held, staying, _), health, metrics = asyncio.run(run())
    assert held[0] == 200 and staying[0] == 200 and health[0] == 200
    assert 'te_request_failure{err="dropped"} 1' in metrics
    computed = {ids for batch in encoder.batches[start:] for ids in batch["ids"]}
    leaving = {tuple(x) for x in encoder.tokenizer(texts[1:5], truncation=True, max_length=256)["input_ids"]}
    assert not computed & leaving
    assert len(encoder.batches) - start == 2  # the held batch, then the staying request's


def test_a_batch_that_fails_is_a_424_for_its_requests_and_the_worker_goes_on(encoder, texts):
    app = serve.app(encoder, auto_truncate=True)

    async def run():
        async with app.router.lifespan_context(app):
            await ready(app)
            encoder.fail = True
            try:
                failed = await call(app, "POST", "/embed", {"inputs": texts[:2]})
                failed_openai = await call(app, "POST", "/v1/embeddings", {"input": texts[:2]})
            finally:
                encoder.fail = False
            return failed, failed_openai, await call(app, "POST", "/embed", {"inputs": texts[:2]}), \
                await call(app, "GET", "/health")

    failed, failed_openai, after, health = asyncio.run(run())
    assert failed == (424, {"error": "the model failed on this batch: RuntimeError: a fault injected into this "
                                     "batch", "error_type": "Backend"})
    assert failed_openai[0] == 424 and failed_openai[1]["error"]["type"] == "server_error"
    assert after[0] == 200 and len(after[1]) == 2 and health[0] == 200


def test_health_is_503_while_loading_and_draining(minilm_path, monkeypatch):
    from fastbert.serve import models
    loading = threading.Event()
    real_load = models.Embedder.load.__func__

    def held_load(cls, *args, **kwargs):
        assert loading.wait(timeout=120)
        return real_load(cls, *args, **kwargs)
    monkeypatch.setattr(models.Embedder, "load", classmethod(held_load))
    app = serve.app(minilm_path, device="cpu", kernels="torch")

    async def run():
        async with app.router.lifespan_context(app):
            seen = [await call(app, "GET", "/health"), await call(app, "POST", "/embed", {"inputs": "a"})]
            loading.set()
            await ready(app)
            seen.append(await call(app, "POST", "/embed", {"inputs": "a"}))
            app.state.service.drain()
            seen += [await call(app, "GET", "/health"), await call(app, "POST", "/embed", {"inputs": "a"})]
        return seen

    loading_health, loading_embed, ready_embed, draining_health, draining_embed = asyncio.run(run())
    assert loading_health == (503, {"error": "the model is loading", "error_type": "Unhealthy"})
    assert loading_embed == loading_health
    assert ready_embed[0] == 200
    assert draining_health == (503, {"error": "the server is shutting down", "error_type": "Unhealthy"})
    assert draining_embed == draining_health


def test_a_model_that_fails_to_load(minilm_path, tmp_path, capsys):
    """A folder whose weights are not a checkpoint: /health says why (503), and the command stops with one line and
    exit code 1; a folder that does not exist is refused before the server starts (exit 2)."""
    import shutil
    folder = tmp_path / "broken"
    shutil.copytree(minilm_path, folder)
    (folder / "model.safetensors").write_bytes(b"not a checkpoint")
    app = serve.app(str(folder), device="cpu")

    async def run():
        async with app.router.lifespan_context(app):
            await until(lambda: app.state.service.state == "failed")
            return await call(app, "GET", "/health")

    status, body = asyncio.run(run())
    assert status == 503 and body["error"].startswith(f"the model failed to load: {folder}: SafetensorError: ")
    code, _, err = main_in_process(capsys, "serve", str(folder), "--port", "0", "--log-level", "critical")
    lines = [line for line in err.splitlines() if line.startswith("python -m fastbert serve: error:")]
    assert code == 1 and len(lines) == 1 and "the model failed to load" in lines[0] and "Traceback" not in err
    code, _, err = main_in_process(capsys, "serve", str(tmp_path / "missing"), "--port", "0")
    assert code == 2 and err.strip() == (f"python -m fastbert serve: error: no such folder: "
                                         f"{str(tmp_path / 'missing')!r}")


def test_options_are_checked_when_the_app_is_built(minilm_path):
    with pytest.raises(ValueError, match="max_batch_tokens must be a positive integer, got 0"):
        serve.app(minilm_path, max_batch_tokens=0)
    with pytest.raises(TypeError, match=r"unknown option\(s\) max_batch_size; the options are api_key, "):
        serve.app(minilm_path, max_batch_size=8)
    app = serve.app(minilm_path, device="cpu", max_batch_tokens=100)  # less than the model's 256 per input

    async def run():
        async with app.router.lifespan_context(app):
            await until(lambda: app.state.service.state == "failed")
            return await call(app, "GET", "/health")
    status, body = asyncio.run(run())
    assert status == 503 and "max_batch_tokens 100 is less than the model's limit of 256 tokens" in body["error"]


def test_the_command_takes_teis_options_with_teis_defaults(capsys):
    from fastbert.cli.serve import serve_parser
    parser = serve_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for action in (a for a in parser._actions if a.option_strings):
        assert action.help and len(action.help) > 10, action.option_strings
        assert all(name in help_text for name in action.option_strings)
    args = parser.parse_args([])
    assert (args.host, args.port, args.max_batch_tokens, args.max_concurrent_requests, args.max_client_batch_size,
            args.payload_limit, args.api_key, args.auto_truncate, args.no_cuda_graphs) == \
        ("127.0.0.1", 8080, 16384, 512, 32, 2_000_000, None, False, False)
    for name in ("--device", "--dtype", "--kernels", "--served-model-name", "--no-cuda-graphs"):
        assert name in help_text


def test_the_commands_parser_needs_neither_fastapi_nor_ray():
    """The flags' defaults come from fastbert.serve.options, which imports nothing of the server: the parser (and
    --help) builds in a process where importing FastAPI or Ray fails, and fastbert.serve.app still names the app."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['fastapi'] = sys.modules['ray'] = None\n"
            "from fastbert.cli.serve import serve_parser\n"
            "args = serve_parser().parse_args([])\n"
            "import fastbert.serve\n"
            "assert 'fastbert.serve.server' not in sys.modules\n"
            "print(args.max_batch_tokens, fastbert.serve.Options().max_batch_tokens)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["16384", "16384"], done.stderr[-2000:]
    assert serve.app.__module__ == "fastbert.serve.server"


def test_the_commands_flags_are_the_apps_options_with_their_defaults(monkeypatch):
    """`python -m fastbert serve`'s flags map onto fastbert.serve.Options field by field (app_options: what one
    process and every Ray replica are built with), and a flag left out gives the field's own default."""
    from dataclasses import fields

    from fastbert.cli.serve import app_options, serve_parser
    monkeypatch.delenv("FASTBERT_API_KEY", raising=False)
    defaults = {f.name: f.default for f in fields(serve.Options)}
    assert app_options(serve_parser().parse_args([]), device=None) == defaults
    given = app_options(serve_parser().parse_args(
        ["--max-batch-tokens", "4096", "--max-concurrent-requests", "9", "--max-client-batch-size", "7",
         "--payload-limit", "1000", "--auto-truncate", "--no-cuda-graphs", "--strict-model-name",
         "--served-model-name", "m", "--api-key", "k", "--tokenization-workers", "2", "--dtype", "float16"]),
        device="cpu")
    assert given == {**defaults, "device": "cpu", "max_batch_tokens": 4096, "max_concurrent_requests": 9,
                     "max_client_batch_size": 7, "payload_limit": 1000, "auto_truncate": True, "cuda_graphs": False,
                     "strict_model_name": True, "served_model_name": "m", "api_key": "k", "tokenization_workers": 2,
                     "dtype": "float16"}
    serve.Options(**given)  # the app takes them as they are
