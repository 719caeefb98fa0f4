"""The ASGI app: `app(model, **options)` builds one, with its own model, worker, queue and metrics (two apps in one
process share nothing). The model loads on a thread of its own when the app's lifespan starts, so the server answers
/health (503) while it loads; the model worker starts with it and stops with the lifespan, after the queue is empty.

Routes, by the kind of model (fastbert/serve/models.py):
    embedding    POST /embed, POST /v1/embeddings, POST / (as /embed), POST /similarity, POST /embed_all,
                 POST /v2/embed (Cohere's)
    sparse       POST /embed_sparse (a SparseEncoder: SPLADE)
    reranker     POST /rerank, POST /predict, POST / (/rerank's body: as /rerank; else as the Inference API's
                 text classification), POST /v2/rerank (Cohere's), POST /v1/rerank (Jina's)
    classifier   POST /predict, POST / (the Hugging Face Inference API's text classification, which
                 huggingface_hub's InferenceClient posts)
    every kind   POST /tokenize, GET /info, GET /health, GET /metrics, GET /v1/models
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from ..dispatch import batch_invariant
from ..encode import SentenceEncoder
from ..loading import bundled_model
from ..version import __version__
from . import errors, schemas
from .errors import BackendFailed, Invalid, NotServed, ServeError, TooLarge, Unavailable, error_response
from .gate import Gate
from .metrics import CONTENT_TYPE, Metrics
from .models import Embedder, Kind, Scorer, Sparser, read_kind, served_name, sigmoid, softmax
from .options import Options
from .scheduler import BackendError, Scheduler, StoppedError, Text, Ticket

logger = logging.getLogger("fastbert.serve")


class ClientGone(Exception):
    """The client went away before its answer: its texts left the queue."""


# the POST routes that compute (te_request_count and TEI's headers), by kind
INFERENCE_ROUTES = {"embedding": ("/embed", "/v1/embeddings", "/", "/similarity", "/embed_all", "/v2/embed"),
                    "reranker": ("/predict", "/rerank", "/", "/v2/rerank", "/v1/rerank"),
                    "classifier": ("/predict", "/"), "sparse": ("/embed_sparse",)}
ALL_INFERENCE_ROUTES = frozenset(path for paths in INFERENCE_ROUTES.values() for path in paths)


@dataclass(eq=False)
class Timing:
    """One request's way through the server: what TEI's response headers and per-request histograms report."""
    started: float                  # perf_counter() when the route began
    method: Optional[str] = None    # "single" / "batch" once its inputs were read (te_request_count counted)
    tokenization: float = 0.0       # seconds its inputs took to tokenize
    chars: int = 0                  # characters of its texts (an id list: its length), as TEI counts them
    tokens: int = 0                 # tokens computed
    queued_at: float = 0.0          # perf_counter() when its texts entered the queue
    batches: list = field(default_factory=list)  # Ticket.batches: (texts, queued s, inference s, s to batch end)

    def count(self, metrics: Metrics, method: str) -> None:
        self.method = method
        metrics.request(method)


def _characters(inputs) -> int:
    """TEI's x-compute-characters: a text's characters, a pair's both, a token-id list's length."""
    return sum(len(x) if not isinstance(x, tuple) else len(x[0]) + len(x[1]) for x in inputs)


class Service:
    """One app's state: the model (once loaded), its scheduler, the tokenizer threads, the metrics, the requests in
    flight, and whether it is loading, ready, draining or failed."""

    def __init__(self, model, options: Options):
        self.options = options
        self._encoder = None
        if isinstance(model, SentenceEncoder):  # a model already in memory
            self._encoder = model
            self.kind = Kind("embedding", "", "")
            self.name = options.served_model_name or "model"
        else:
            self.kind = read_kind(bundled_model() if model is None else model)
            self.name = options.served_model_name or served_name(model, self.kind.folder)
        self.metrics = Metrics("embed" if self.kind.name in ("embedding", "sparse") else "predict")
        self.counted_paths = frozenset(INFERENCE_ROUTES[self.kind.name])
        self.model_names = {self.name} | ({os.fspath(model)} if isinstance(model, (str, os.PathLike)) else set())
        self.state, self.error = "loading", None
        self.model = self.scheduler = None
        self.in_flight = 0
        self.created = int(time.time())
        self.on_failure = None  # called with the message when loading fails (the CLI stops the server)
        self.compute_type = None  # TEI's x-compute-type, once the model's device is known
        # The lifespan's startup returns at once and the model loads behind it (/health: 503 meanwhile), unless a host
        # routes requests to the app as soon as its startup completes (a Ray Serve replica): then the startup waits
        # for the model and fails with the reason if it cannot load.
        self.load_before_serving = False
        self.tokenization_workers = options.tokenization_workers or min(4, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._loader: threading.Thread | None = None

    # ---- state ---------------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.scheduler is not None and self.scheduler.alive

    def unready_reason(self) -> str:
        if self.state == "failed":
            return f"the model failed to load: {self.error}"
        if self.state == "ready":
            return "the model worker has stopped"
        return {"loading": "the model is loading", "draining": "the server is shutting down"}[self.state]

    def drain(self) -> None:
        """Stop taking new work (503); what was accepted finishes."""
        if self.state in ("loading", "ready"):
            self.state = "draining"

    # ---- loading and the lifespan --------------------------------------------------------------------------------
    def _load(self) -> None:
        """The model worker: loads the model, warms it up, then runs every batch, all under batch invariance (a
        text's vector never depends on what it was batched with: fastbert.batch_invariant)."""
        with batch_invariant():
            self._load_and_work()

    def _load_and_work(self) -> None:
        options = self.options
        try:
            common = dict(device=options.device, dtype=options.dtype, kernels=options.kernels,
                          cuda_graphs=options.cuda_graphs, quantize=options.quantize,
                          quality_texts=options.quality_texts)
            if self._encoder is not None:
                model = Embedder(self._encoder)
            elif self.kind.name == "embedding":
                model = Embedder.load(self.kind.folder, **common)
            else:
                loader = Sparser if self.kind.name == "sparse" else Scorer
                model = loader.load(self.kind, options.max_batch_tokens, **common)
            if options.max_batch_tokens < model.limit:
                raise ValueError(f"max_batch_tokens {options.max_batch_tokens} is less than the model's limit of "
                                 f"{model.limit} tokens per input: an input at the limit would not fit a batch")
            self.metrics.limit_input_length(model.limit)
            scheduler = Scheduler(model.run, options.max_batch_tokens, self.metrics)
            model.run(model.prepare(*self._warmup_args(model)))  # first-call work (graphs, caches) here
        except Exception as e:  # noqa: BLE001 - reported on /health and to the CLI, which exits
            where = f"{self.kind.folder}: " if self.kind.folder else ""
            self.state, self.error = "failed", f"{where}{type(e).__name__}: {' '.join(str(e).split())}"
            logger.error("fastbert serve: the model failed to load: %s", self.error)
            if self.on_failure is not None:
                self.on_failure(self.error)
            return
        self.model, self.scheduler = model, scheduler

        def started():
            if self.state == "loading":
                self.state = "ready"
                logger.info("fastbert serve: %s model %s ready (%s, %s, max %d tokens per input)", model.kind,
                            self.name, model.device, model.dtype, model.limit)
        scheduler.work(started)  # this thread, which loaded the model, runs every batch until the lifespan ends

    @staticmethod
    def _warmup_args(model):
        if model.kind == "embedding":
            return ["warm up"], "", None, True, "right", "inputs"
        return ["warm up"], True, "right", "inputs"

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self._pool = ThreadPoolExecutor(self.tokenization_workers, thread_name_prefix="fastbert-tokenize")
        self._loader = threading.Thread(target=self._load, name="fastbert-model-worker", daemon=True)
        self._loader.start()
        try:
            if self.load_before_serving:
                while self.state == "loading":
                    await asyncio.sleep(0.05)
                if self.state != "ready":
                    raise RuntimeError(self.unready_reason())
            yield
        finally:
            self.drain()
            loop = asyncio.get_running_loop()
            while self.state == "draining" and self.scheduler is None and self._loader.is_alive():
                await asyncio.sleep(0.05)  # still loading: the worker starts, then stops at once
            if self.scheduler is not None:
                await loop.run_in_executor(None, self.scheduler.stop)
            await loop.run_in_executor(None, self._loader.join)
            self._pool.shutdown(wait=True)

    # ---- the work ------------------------------------------------------------------------------------------------
    async def off_loop(self, fn, *args):
        """fn(*args) on a tokenizer thread (tokenizing holds the event loop for no one)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def truncating(self, truncate: Optional[bool]) -> bool:
        """A request's truncate, or the server's auto_truncate when it does not say (TEI's rule)."""
        return self.options.auto_truncate if truncate is None else truncate

    def check_count(self, count: int, field: str) -> None:
        limit = self.options.max_client_batch_size
        if count > limit:
            raise TooLarge(f"{field}: {count} inputs, more than the limit of {limit} per request "
                                  f"(max_client_batch_size)", param=field, label="batch_size")

    async def compute(self, request: Request, payloads: list) -> list:
        """The payloads through the queue and the model worker -> their results, in order. If the client goes away
        first, its texts leave the queue (ClientGone)."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(loop, len(payloads))
        try:
            self.scheduler.submit(ticket, [Text(p, len(p.ids), ticket, i) for i, p in enumerate(payloads)])
        except StoppedError as e:
            raise Unavailable(str(e)) from None
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({ticket.future, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (the server is being stopped hard): nobody waits for these texts
            self.scheduler.drop(ticket)
            raise
        finally:
            gone.cancel()
        if not ticket.future.done():
            self.scheduler.drop(ticket)
            raise ClientGone()
        try:
            results = ticket.future.result()
        except BackendError as e:
            raise BackendFailed(str(e)) from None
        timing = getattr(request.state, "timing", None)
        if timing is not None:
            timing.queued_at, timing.batches = ticket.queued_at, ticket.batches
        return results

    async def tokenized(self, request: Request, prepare, inputs: list, *args) -> list:
        """prepare(inputs, *args) on a tokenizer thread -> payloads; the request's tokenization time, characters and
        tokens noted, and each input's length counted."""
        started = time.perf_counter()
        self.metrics.received(len(inputs))
        payloads = await self.off_loop(prepare, inputs, *args)
        lengths = [len(p.ids) for p in payloads]
        self.metrics.tokenized(lengths)
        timing = getattr(request.state, "timing", None)
        if timing is not None:
            timing.tokenization = time.perf_counter() - started
            timing.chars, timing.tokens = _characters(inputs), sum(lengths)
        return payloads

    async def embed(self, request: Request, inputs: list, *, prompt_name, task, truncate, direction, field,
                    dimensions, tokens: bool = False) -> tuple[Any, int]:
        """Pooled vectors of `inputs` (texts or token ids) and the tokens they took; tokens: per input, its token
        vectors [tokens, hidden] instead (a list of arrays)."""
        model = self.model
        self.check_count(len(inputs), field)
        if dimensions is not None and dimensions > model.dimension:
            raise Invalid(f"dimensions: {dimensions} is more than the model's {model.dimension}",
                             param="dimensions")
        model.check_task(task)
        prompt = model.prompt(prompt_name, task)
        payloads = await self.tokenized(request, model.prepare, inputs, prompt, task, self.truncating(truncate),
                                        direction, field, tokens)
        results = await self.compute(request, payloads)
        return (results if tokens else np.stack(results)), sum(len(p.ids) for p in payloads)

    async def score(self, request: Request, inputs: list, *, truncate, direction, field) -> Any:
        """Logits [inputs, labels] of texts and pairs (a sparse model: per text, its (indices, values))."""
        self.check_count(len(inputs), field)
        payloads = await self.tokenized(request, self.model.prepare, inputs, self.truncating(truncate), direction,
                                        field)
        results = await self.compute(request, payloads)
        return results if self.kind.name == "sparse" else np.stack(results)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _finish(vectors: np.ndarray, dimensions: Optional[int], normalize: bool) -> np.ndarray:
    """Each vector cut to `dimensions`, then L2-normalised when asked: per vector, so nothing else in the batch
    changes it."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
        vectors = (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
    return vectors


# Cohere's input_type -> the folder's prompt of that name, else of these names, else the folder's default prompt
_COHERE_PROMPTS = {"search_query": ("query",), "search_document": ("document", "passage")}


def _prompt_for(model, input_type: Optional[str]) -> Optional[str]:
    if input_type is None:
        return None
    prompts = model.encoder.pipeline.prompts
    return next((name for name in (input_type, *_COHERE_PROMPTS.get(input_type, ())) if name in prompts), None)


def _cohere_embeddings(vectors: np.ndarray, kind: str) -> list:
    """Cohere's embedding types, as sentence-transformers' quantize_embeddings computes the binary ones: ubinary,
    the signs (> 0) packed 8 to a byte; binary, the same bytes less 128."""
    if kind == "float":
        return vectors.tolist()
    if kind == "base64":
        return [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    packed = np.packbits(vectors > 0, axis=-1)
    return packed.tolist() if kind == "ubinary" else (packed.astype(np.int16) - 128).tolist()


def _predictions(logits: np.ndarray, labels: tuple, how: str) -> list[dict]:
    """One text's logits -> [{"score", "label"}], highest score first. how: "softmax" / "sigmoid" / "none"."""
    scores = softmax(logits) if how == "softmax" else sigmoid(logits) if how == "sigmoid" else logits
    order = sorted(range(len(labels)), key=lambda i: -scores[i])
    return [{"score": float(scores[i]), "label": labels[i]} for i in order]


def _activation(labels: tuple, raw: bool) -> str:
    """TEI's scores: sigmoid of a single logit, softmax over several; raw_scores: the logits."""
    return "none" if raw else ("sigmoid" if len(labels) == 1 else "softmax")


class _JSON(JSONResponse):
    # json.dumps' own default: a non-finite number (an fp16 overflow) is written as NaN / Infinity rather than
    # failing the request
    def render(self, content) -> bytes:
        import json
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def app(model=None, **options) -> FastAPI:
    """The server as an ASGI app (FastAPI): run it under uvicorn, gunicorn's uvicorn workers or Ray Serve.

    model: a folder (a sentence-transformers folder, a plain encoder folder, or a *ForSequenceClassification folder
        with one label (a reranker) or several (a classifier)), a cached Hub id, or a fastbert.SentenceEncoder
        already loaded; None: the bundled all-MiniLM-L6-v2.
    options: Options' fields (device, dtype, kernels, max_batch_tokens, max_concurrent_requests,
        max_client_batch_size, auto_truncate, payload_limit, api_key, served_model_name, strict_model_name,
        cuda_graphs, tokenization_workers).
    The folder's kind is read now (a bad folder raises here); the weights load when the lifespan starts."""
    known = {f.name for f in fields(Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known))}")
    service = Service(model, Options(**options))
    api = FastAPI(title="fastbert serve", version=__version__, lifespan=service.lifespan,
                  description=f"{service.kind.name} model {service.name}")
    api.state.service = service
    _add_routes(api, service)
    _with_request_bodies(api)

    async def on_serve_error(request: Request, error: ServeError):
        path = request.url.path[len(request.scope.get("root_path", "")):]
        if error.label is not None and (path in service.counted_paths or path == "/tokenize"):
            timing = getattr(request.state, "timing", None)
            if path in service.counted_paths and (timing is None or timing.method is None):
                service.metrics.request(None)  # refused before its inputs were read (its body, its JSON)
            service.metrics.failure(error.label)
        return error_response(path, error)

    async def on_http_error(request: Request, error: HTTPException):
        path = request.url.path[len(request.scope.get("root_path", "")):]
        if request.method == "POST" and path in ALL_INFERENCE_ROUTES:  # another kind's route, as TEI counts it
            service.metrics.request(None)
            service.metrics.failure("model_type")
        message = error.detail
        if error.status_code in (404, 405):
            message = (f"no route {request.method} {path} for this {service.kind.name} model; its routes: "
                       f"{', '.join(_route_names(api))}")
        return error_response(path, ServeError.of_status(error.status_code, message))

    api.add_exception_handler(ServeError, on_serve_error)
    api.add_exception_handler(HTTPException, on_http_error)
    api.add_middleware(Gate, service=service)
    return api


def _route_names(api: FastAPI) -> list[str]:
    return [f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path}" for r in api.routes
            if getattr(r, "include_in_schema", False) and getattr(r, "methods", None)]


# ---- /openapi.json: what each route takes and answers ----------------------------------------------------------------
# The routes read their bodies themselves (schemas.parse: strict, with messages naming the field), so each body is
# declared here, by its model's schema, for client generators and fuzzers.
_REFUSALS = {kind.status: kind.__doc__ for kind in errors.KINDS}  # each kind of error: when it is answered
_KEY_REFUSED = {401: {"model": schemas.TEIError, "description": _REFUSALS[401]}}


def _documented(bodies, answer, openai: bool = False, error=None) -> dict:
    """A POST route's openapi: its body (one model, or any of several) and its answers (error: the error body, by
    default TEI's, OpenAI's with openai)."""
    bodies = bodies if isinstance(bodies, tuple) else (bodies,)
    refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in bodies]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    error = error or (schemas.OpenAIError if openai else schemas.TEIError)
    responses = {200: {"model": answer, "description": "the answer"},
                 **{status: {"model": error, "description": what} for status, what in _REFUSALS.items()}}
    return {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}},
            "responses": responses, "response_class": _JSON}


def _get_answers(answer, openai: bool = False) -> dict:
    error = schemas.OpenAIError if openai else schemas.TEIError
    return {200: {"model": answer, "description": "the answer"},
            401: {"model": error, "description": _REFUSALS[401]}}


REQUEST_MODELS = (schemas.EmbedRequest, schemas.OpenAIEmbeddingRequest, schemas.RerankRequest, schemas.PredictRequest,
                  schemas.TokenizeRequest, schemas.TextClassificationRequest, schemas.SimilarityRequest,
                  schemas.EmbedAllRequest, schemas.CohereEmbedRequest, schemas.CohereRerankRequest,
                  schemas.JinaRerankRequest, schemas.EmbedSparseRequest)


def _with_request_bodies(api: FastAPI) -> None:
    """api.openapi() with the request models' schemas among its components (the routes' bodies refer to them)."""
    from pydantic.json_schema import models_json_schema
    build = api.openapi

    def openapi():
        if api.openapi_schema is None:
            document = build()
            _, definitions = models_json_schema([(model, "validation") for model in REQUEST_MODELS],
                                                ref_template="#/components/schemas/{model}")
            document.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
        return api.openapi_schema
    api.openapi = openapi


# ---- the routes: handlers of (service, request), and the table of them per kind --------------------------------------
def _timed(service: Service, route):
    """An inference route: its success counted, its timings in TEI's histograms and response headers; its errors are
    counted by the error handler."""
    metrics = service.metrics

    @functools.wraps(route)
    async def run(request: Request):
        timing = request.state.timing = Timing(time.perf_counter())
        try:
            response = await route(request)
        except ClientGone:
            metrics.failure("dropped")
            return Response(status_code=499)  # nobody reads it
        total = time.perf_counter() - timing.started
        offset = timing.queued_at - timing.started  # a batch's end, from the request's arrival
        queue, inference = metrics.success(timing.method, total, timing.tokenization,
                                           [(n, q, i, offset + e) for n, q, i, e in timing.batches])
        if service.compute_type is None:
            service.compute_type = b"cpu" if service.model.device == "cpu" else b"gpu+optimized"
        total_ms = b"%d" % (total * 1e3)
        # appended to the raw list: starlette's header mapping rescans the list on each assignment
        response.raw_headers.extend((
            (b"x-compute-type", service.compute_type), (b"x-compute-time", total_ms), (b"x-total-time", total_ms),
            (b"x-compute-characters", b"%d" % timing.chars), (b"x-compute-tokens", b"%d" % timing.tokens),
            (b"x-tokenization-time", b"%d" % (timing.tokenization * 1e3)),
            (b"x-queue-time", b"%d" % (queue * 1e3)), (b"x-inference-time", b"%d" % (inference * 1e3))))
        return response
    return run


async def _body_of(service: Service, request: Request, model_class, field: Optional[str] = "inputs"):
    """The body as `model_class`; te_request_count counted with TEI's method (`field`'s shape: one input or a list of
    them; None: always "batch", as TEI counts /rerank)."""
    data = schemas.load_json(await request.body())
    _count(service, request, data, field, pairs=model_class is schemas.PredictRequest)
    return schemas.validate(model_class, data)


def _count(service: Service, request: Request, data: dict, field: Optional[str], pairs: bool = False) -> None:
    timing = getattr(request.state, "timing", None)
    method = schemas.method_of(data.get(field), pairs) if field is not None else "batch"
    if timing is not None and method is not None:
        timing.count(service.metrics, method)


def _check_model(service: Service, name: Optional[str]) -> None:
    """With --strict-model-name, a 404 for a `model` other than the one served (by default any name is answered, as
    TEI answers it)."""
    if service.options.strict_model_name and name is not None and name not in service.model_names:
        raise NotServed(f"model: {name!r} is not served here (this server serves {service.name!r})", param="model",
                        code="model_not_found")


async def _embed_answer(service: Service, request: Request, body: schemas.EmbedRequest):
    vectors, _ = await service.embed(request, body.inputs, prompt_name=body.prompt_name, task=body.task,
                                     truncate=body.truncate, direction=body.truncation_direction, field="inputs",
                                     dimensions=body.dimensions)
    return _JSON([v.tolist() for v in _finish(vectors, body.dimensions, body.normalize)])


async def _rerank_answer(service: Service, request: Request, body: schemas.RerankRequest):
    logits = await service.score(request, [(body.query, t) for t in body.texts], truncate=body.truncate,
                                 direction=body.truncation_direction, field="texts")
    scores = logits[:, 0] if body.raw_scores else sigmoid(logits[:, 0])
    ranks = []
    for i in sorted(range(len(scores)), key=lambda i: -scores[i]):
        ranks.append({"index": i, "score": float(scores[i]), **({"text": body.texts[i]} if body.return_text else {})})
    return _JSON(ranks)


async def _ranked(service: Service, request: Request, query: str, documents: list, top_n: Optional[int]) -> list:
    """(index, relevance) of each document, best first, top_n of them: the reranker's sigmoid, as
    CrossEncoder.predict gives it. Cohere's and Jina's APIs cut a long document rather than refuse it."""
    logits = await service.score(request, [(query, d) for d in documents], truncate=True, direction="right",
                                 field="documents")
    scores = sigmoid(logits[:, 0])
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [(i, float(scores[i])) for i in order[:top_n]]


async def _predict_logits(service: Service, request: Request, inputs, truncate, direction):
    single = not isinstance(inputs, list)
    items = [inputs] if single else inputs
    return single, await service.score(request, items, truncate=truncate, direction=direction, field="inputs")


async def _embed(service: Service, request: Request):
    return await _embed_answer(service, request, await _body_of(service, request, schemas.EmbedRequest))


async def _openai_embeddings(service: Service, request: Request):
    body = await _body_of(service, request, schemas.OpenAIEmbeddingRequest, "input")
    _check_model(service, body.model)
    vectors, tokens = await service.embed(request, body.input, prompt_name=body.prompt_name, task=body.task,
                                          truncate=None, direction="right", field="input", dimensions=body.dimensions)
    vectors = _finish(vectors, body.dimensions, service.model.normalize)
    if body.encoding_format == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        data = [v.tolist() for v in vectors]
    return _JSON({"object": "list", "model": service.name,
                  "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _similarity(service: Service, request: Request):
    body = await _body_of(service, request, schemas.SimilarityRequest, None)
    parameters = body.parameters or schemas.SimilarityParameters()
    texts = [body.inputs.source_sentence, *body.inputs.sentences]
    vectors, _ = await service.embed(request, texts, prompt_name=parameters.prompt_name, task=None,
                                     truncate=parameters.truncate, direction=parameters.truncation_direction,
                                     field="inputs.sentences", dimensions=None)
    unit = _finish(vectors, None, True).astype(np.float64)
    return _JSON((unit[1:] @ unit[0]).tolist())


async def _embed_all(service: Service, request: Request):
    body = await _body_of(service, request, schemas.EmbedAllRequest)
    tokens, _ = await service.embed(request, body.inputs, prompt_name=body.prompt_name, task=None,
                                    truncate=body.truncate, direction=body.truncation_direction, field="inputs",
                                    dimensions=None, tokens=True)
    return _JSON([t.tolist() for t in tokens])


async def _cohere_embed(service: Service, request: Request):
    body = await _body_of(service, request, schemas.CohereEmbedRequest, None)
    _check_model(service, body.model)
    vectors, tokens = await service.embed(
        request, body.texts, prompt_name=_prompt_for(service.model, body.input_type), task=None,
        truncate=body.truncate != "NONE", direction="left" if body.truncate == "START" else "right", field="texts",
        dimensions=body.output_dimension)
    vectors = _finish(vectors, body.output_dimension, service.model.normalize)
    return _JSON({"id": uuid.uuid4().hex, "response_type": "embeddings_by_type",
                  "embeddings": {kind: _cohere_embeddings(vectors, kind) for kind in body.embedding_types},
                  "texts": body.texts,
                  "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}}})


async def _embed_sparse(service: Service, request: Request):
    body = await _body_of(service, request, schemas.EmbedSparseRequest)
    weights = await service.score(request, body.inputs, truncate=body.truncate, direction=body.truncation_direction,
                                  field="inputs")
    return _JSON([[{"index": int(i), "value": float(v)} for i, v in zip(*w)] for w in weights])


async def _predict(service: Service, request: Request):
    labels = service.kind.labels
    body = await _body_of(service, request, schemas.PredictRequest)
    single, logits = await _predict_logits(service, request, body.inputs, body.truncate, body.truncation_direction)
    how = _activation(labels, body.raw_scores)
    predictions = [_predictions(row, labels, how) for row in logits]
    return _JSON(predictions[0] if single else predictions)


async def _rerank(service: Service, request: Request):
    return await _rerank_answer(service, request, await _body_of(service, request, schemas.RerankRequest, None))


async def _cohere_rerank(service: Service, request: Request):
    body = await _body_of(service, request, schemas.CohereRerankRequest, None)
    _check_model(service, body.model)
    ranks = await _ranked(service, request, body.query, body.documents, body.top_n)
    return _JSON({"id": uuid.uuid4().hex, "results": [{"index": i, "relevance_score": s} for i, s in ranks],
                  "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}})


async def _jina_rerank(service: Service, request: Request):
    body = await _body_of(service, request, schemas.JinaRerankRequest, None)
    _check_model(service, body.model)
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    ranks = await _ranked(service, request, body.query, documents, body.top_n)
    results = [{"index": i, "relevance_score": score,
                **({"document": {"text": documents[i]}} if body.return_documents else {})} for i, score in ranks]
    return _JSON({"model": service.name, "usage": {"total_tokens": request.state.timing.tokens}, "results": results})


async def _classify(service: Service, request: Request):
    """The Inference API's text classification; a reranker's root also takes /rerank's body."""
    labels = service.kind.labels
    data = schemas.load_json(await request.body())
    if service.kind.name == "reranker" and "query" in data:
        _count(service, request, data, None)
        return await _rerank_answer(service, request, schemas.validate(schemas.RerankRequest, data))
    _count(service, request, data, "inputs", pairs=True)
    body = schemas.validate(schemas.TextClassificationRequest, data)
    parameters = body.parameters or schemas.ClassificationParameters()
    single, logits = await _predict_logits(service, request, body.inputs, None, "right")
    how = parameters.function_to_apply or _activation(labels, False)
    predictions = [_predictions(row, labels, how)[:parameters.top_k] for row in logits]
    return _JSON(predictions)  # a list per input, a single input's too, as the Inference API answers


async def _tokenize(service: Service, request: Request):
    body = await _body_of(service, request, schemas.TokenizeRequest)
    service.check_count(len(body.inputs), "inputs")
    model, embedding = service.model, service.kind.name == "embedding"
    prompt = model.prompt(body.prompt_name, None) if embedding else ""
    if not embedding and body.prompt_name is not None:
        raise Invalid("prompt_name: this model has no prompts", param="prompt_name")
    return _JSON(await service.off_loop(_tokens, model, [prompt + t for t in body.inputs], body.add_special_tokens))


async def _info(service: Service, request: Request):
    model, kind = service.model, service.kind.name
    if kind == "embedding":
        pipeline = model.encoder.pipeline if model is not None else None
        model_type = {"embedding": {"pooling": "+".join(pipeline.pooling) if pipeline else None}}
    elif kind == "sparse":
        model_type = {"embedding": {"pooling": "splade"}}  # TEI's name for a SPLADE model's pooling
    else:
        label2id = {label: i for i, label in enumerate(service.kind.labels)}
        model_type = {kind: {"id2label": dict(enumerate(service.kind.labels)), "label2id": label2id}}
    return _JSON({
        "model_id": service.name, "model_sha": None, "model_dtype": model.dtype if model else None,
        "model_type": model_type, "max_concurrent_requests": service.options.max_concurrent_requests,
        "max_input_length": model.limit if model else None, "max_batch_tokens": service.options.max_batch_tokens,
        "max_batch_requests": None, "max_client_batch_size": service.options.max_client_batch_size,
        "auto_truncate": service.options.auto_truncate, "tokenization_workers": service.tokenization_workers,
        "version": __version__, "sha": None, "docker_label": None, "state": service.state,
        "device": model.device if model else None,
        "prompts": dict(model.encoder.pipeline.prompts) if model is not None and kind == "embedding" else None,
        "tasks": list(model.tasks) if model is not None and kind == "embedding" else None,
        "quantize": model.quantize if model else None,
        "format_quality": model.format_quality.figures() if model and model.format_quality else None})


async def _health(service: Service, request: Request):
    if service.ready:
        return Response(status_code=200)
    return error_response("/health", Unavailable(service.unready_reason()))


async def _prometheus(service: Service, request: Request):
    return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)


async def _openai_models(service: Service, request: Request):
    return _JSON({"object": "list", "data": [{"id": service.name, "object": "model", "created": service.created,
                                              "owned_by": "fastbert"}]})


class Route(NamedTuple):
    """One route: its method and path, its handler (service, request) -> response, its summary and its openapi
    (FastAPI's route keywords); timed: an inference route (counted, timed, TEI's headers)."""
    method: str
    path: str
    handler: Any
    summary: str
    openapi: dict
    timed: bool = True


_HEALTH = {"response_class": Response,
           "responses": {200: {"description": "the model answers (no body)", "content": {}},
                         503: {"model": schemas.TEIError, "description": "loading, failed to load, or draining"}}}
_METRICS = {"response_class": Response,
            "responses": {200: {"description": "Prometheus' text format",
                                "content": {"text/plain": {"schema": {"type": "string"}}}}, **_KEY_REFUSED}}
_COHERE = {"error": schemas.CohereError}

COMMON_ROUTES = (
    Route("POST", "/tokenize", _tokenize, "TEI's /tokenize: the tokens of each input",
          _documented(schemas.TokenizeRequest, schemas.Tokens), timed=False),
    Route("GET", "/info", _info, "the model and the server's limits", {"responses": _get_answers(schemas.Info)},
          timed=False),
    Route("GET", "/health", _health, "200 when the model answers; 503 while it loads, after it failed, or while "
          "draining", _HEALTH, timed=False),
    Route("GET", "/metrics", _prometheus, "Prometheus metrics, under TEI's names", _METRICS, timed=False),
    Route("GET", "/v1/models", _openai_models, "OpenAI's model list: the one model served",
          {"responses": _get_answers(schemas.ModelList, openai=True)}, timed=False),
)
_PREDICT = Route("POST", "/predict", _predict, "TEI's /predict: labels and scores per text or pair",
                 _documented(schemas.PredictRequest, schemas.Predictions))
_CLASSIFY_SUMMARY = "the Inference API's text classification (InferenceClient.text_classification)"
# the routes of each kind, besides COMMON_ROUTES
ROUTES = {
    "embedding": (
        Route("POST", "/embed", _embed, "TEI's /embed: one vector per input",
              _documented(schemas.EmbedRequest, schemas.Embeddings)),
        Route("POST", "/v1/embeddings", _openai_embeddings, "OpenAI's embeddings",
              _documented(schemas.OpenAIEmbeddingRequest, schemas.OpenAIEmbeddings, openai=True)),
        Route("POST", "/", _embed, "TEI's root: as /embed (huggingface_hub's feature_extraction posts here)",
              _documented(schemas.EmbedRequest, schemas.Embeddings)),
        Route("POST", "/similarity", _similarity, "TEI's /similarity: the cosine of source_sentence with each "
              "sentence", _documented(schemas.SimilarityRequest, schemas.Similarities)),
        Route("POST", "/embed_all", _embed_all, "TEI's /embed_all: every token's vector, per input",
              _documented(schemas.EmbedAllRequest, schemas.TokenEmbeddings)),
        Route("POST", "/v2/embed", _cohere_embed, "Cohere's v2 embed (texts)",
              _documented(schemas.CohereEmbedRequest, schemas.CohereEmbeddings, **_COHERE)),
    ),
    "sparse": (
        Route("POST", "/embed_sparse", _embed_sparse, "TEI's /embed_sparse: per input, its non-zero vocabulary "
              "weights", _documented(schemas.EmbedSparseRequest, schemas.SparseEmbeddings)),
    ),
    "reranker": (
        _PREDICT,
        Route("POST", "/rerank", _rerank, "TEI's /rerank: texts scored against a query, best first",
              _documented(schemas.RerankRequest, schemas.Ranks)),
        Route("POST", "/v2/rerank", _cohere_rerank, "Cohere's v2 rerank",
              _documented(schemas.CohereRerankRequest, schemas.CohereRanks, **_COHERE)),
        Route("POST", "/v1/rerank", _jina_rerank, "Jina's v1 rerank",
              _documented(schemas.JinaRerankRequest, schemas.JinaRanks, openai=True)),
        Route("POST", "/", _classify, _CLASSIFY_SUMMARY + "; a reranker also takes /rerank's body",
              _documented((schemas.TextClassificationRequest, schemas.RerankRequest),
                          Union[schemas.Predictions, schemas.Ranks])),
    ),
    "classifier": (
        _PREDICT,
        Route("POST", "/", _classify, _CLASSIFY_SUMMARY,
              _documented(schemas.TextClassificationRequest, schemas.Predictions)),
    ),
}


def _add_routes(api: FastAPI, service: Service) -> None:
    """The kind's routes and the common ones, each handler bound to this app's service."""
    for route in ROUTES[service.kind.name] + COMMON_ROUTES:
        endpoint = _bound(service, route.handler)
        if route.timed:
            endpoint = _timed(service, endpoint)
        api.add_api_route(route.path, endpoint, methods=[route.method], summary=route.summary, **route.openapi)


def _bound(service: Service, handler):
    """handler(service, request) as the endpoint FastAPI calls with the request."""
    async def endpoint(request: Request):
        return await handler(service, request)
    endpoint.__name__ = endpoint.__qualname__ = handler.__name__.lstrip("_")
    return endpoint


def _tokens(model, texts: list, add_special_tokens: bool) -> list:
    """TEI's /tokenize answer: per text, its tokens {id, text, special, start, stop} (offsets into the text the
    tokenizer saw; a special token has none)."""
    tokenizer = model.tokenizer
    fast = getattr(tokenizer, "is_fast", False)
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens, return_special_tokens_mask=True,
                        return_offsets_mapping=fast, return_attention_mask=False, return_token_type_ids=False)
    out = []
    for i, text in enumerate(texts):
        ids, special = encoded["input_ids"][i], encoded["special_tokens_mask"][i]
        offsets = encoded["offset_mapping"][i] if fast else [None] * len(ids)
        names = tokenizer.convert_ids_to_tokens(ids)
        tokens = []
        for token_id, is_special, offset, name in zip(ids, special, offsets, names):
            if is_special or offset is None:
                tokens.append({"id": token_id, "text": name, "special": bool(is_special), "start": None,
                               "stop": None})
            else:
                tokens.append({"id": token_id, "text": text[offset[0]:offset[1]], "special": False,
                               "start": offset[0], "stop": offset[1]})
        out.append(tokens)
    return out
