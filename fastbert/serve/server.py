"""The ASGI app: `app(model, **options)` builds one, with its own model, worker, queue and metrics (two apps in one
process share nothing). The model loads on a thread of its own when the app's lifespan starts, so the server answers
/health (503) while it loads; the model worker starts with it and stops with the lifespan, after the queue is empty.

Routes, by the kind of model (fastbert/serve/models.py):
    embedding    POST /embed, POST /v1/embeddings, POST / (as /embed)
    reranker     POST /rerank, POST /predict, POST / (/rerank's body: as /rerank; else as the Inference API's
                 text classification)
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import numpy as np
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from ..dispatch import batch_invariant
from ..encode import SentenceEncoder
from ..loading import bundled_model
from ..version import __version__
from . import schemas
from .errors import FAILURE_LABELS, ServeError, error_response
from .gate import Gate
from .metrics import CONTENT_TYPE, Metrics
from .models import Embedder, Kind, Scorer, read_kind, sigmoid, softmax
from .scheduler import BackendError, Scheduler, StoppedError, Text, Ticket

logger = logging.getLogger("fastbert.serve")
DEFAULT_NAME = "all-MiniLM-L6-v2"  # the bundled model's name on /v1 (its package keeps it in a folder named "model")


@dataclass(frozen=True)
class Options:
    """The server's options, under TEI's names and defaults where TEI has them."""
    device: Optional[str] = None              # None: cuda when available, else cpu
    dtype: Optional[str] = None               # None: what the folder says
    kernels: Any = "auto"                     # as fastbert.BertModel takes it
    max_batch_tokens: int = 16384             # real tokens per batch (no padding is computed)
    max_concurrent_requests: int = 512        # POSTs in flight; past it, 429 at once
    max_client_batch_size: int = 32           # inputs per request; past it, 413
    auto_truncate: bool = False               # cut inputs past the model's limit when a request does not say
    payload_limit: int = 2_000_000            # request body bytes; past it, 413
    api_key: Optional[str] = field(default=None, repr=False)   # never printed
    served_model_name: Optional[str] = None   # /v1's model name (default: the folder's name)
    cuda_graphs: bool = True                  # CUDA graphs over token buckets on a GPU
    tokenization_workers: Optional[int] = None  # threads that tokenize (default: min(4, CPUs))

    def __post_init__(self):
        for name in ("max_batch_tokens", "max_concurrent_requests", "max_client_batch_size", "payload_limit",
                     "tokenization_workers"):
            value = getattr(self, name)
            if value is None and name == "tokenization_workers":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string (or None: no key)")
        for name in ("cuda_graphs", "auto_truncate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


class ClientGone(Exception):
    """The client went away before its answer: its texts left the queue."""


class Service:
    """One app's state: the model (once loaded), its scheduler, the tokenizer threads, the metrics, the requests in
    flight, and whether it is loading, ready, draining or failed."""

    def __init__(self, model, options: Options):
        self.options = options
        self.metrics = Metrics()
        self._encoder = None
        if isinstance(model, SentenceEncoder):  # a model already in memory
            self._encoder = model
            self.kind = Kind("embedding", "", "")
            self.name = options.served_model_name or "model"
        else:
            self.kind = read_kind(bundled_model() if model is None else model)
            folder_name = DEFAULT_NAME if model is None else os.path.basename(os.path.normpath(self.kind.folder))
            self.name = options.served_model_name or folder_name
        self.model_names = {self.name} | ({os.fspath(model)} if isinstance(model, (str, os.PathLike)) else set())
        self.state, self.error = "loading", None
        self.model = self.scheduler = None
        self.in_flight = 0
        self.created = int(time.time())
        self.on_failure = None  # called with the message when loading fails (the CLI stops the server)
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
                          cuda_graphs=options.cuda_graphs)
            if self._encoder is not None:
                model = Embedder(self._encoder)
            elif self.kind.name == "embedding":
                model = Embedder.load(self.kind.folder, **common)
            else:
                model = Scorer.load(self.kind, options.max_batch_tokens, **common)
            if options.max_batch_tokens < model.limit:
                raise ValueError(f"max_batch_tokens {options.max_batch_tokens} is less than the model's limit of "
                                 f"{model.limit} tokens per input: an input at the limit would not fit a batch")
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
            raise ServeError(413, f"{field}: {count} inputs, more than the limit of {limit} per request "
                                  f"(max_client_batch_size)", param=field)

    async def compute(self, request: Request, payloads: list) -> list:
        """The payloads through the queue and the model worker -> their results, in order. If the client goes away
        first, its texts leave the queue (ClientGone)."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(loop, len(payloads))
        try:
            self.scheduler.submit(ticket, [Text(p, len(p[0]), ticket, i) for i, p in enumerate(payloads)])
        except StoppedError as e:
            raise ServeError(503, str(e)) from None
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
            return ticket.future.result()
        except BackendError as e:
            raise ServeError(424, str(e)) from None

    async def embed(self, request: Request, inputs: list, *, prompt_name, task, truncate, direction, field,
                    dimensions) -> tuple[np.ndarray, int]:
        """Pooled vectors of `inputs` (texts or token ids) and the tokens they took."""
        model = self.model
        self.check_count(len(inputs), field)
        if dimensions is not None and dimensions > model.dimension:
            raise ServeError(422, f"dimensions: {dimensions} is more than the model's {model.dimension}",
                             param="dimensions")
        model.check_task(task)
        prompt = model.prompt(prompt_name, task)
        payloads = await self.off_loop(model.prepare, inputs, prompt, task, self.truncating(truncate), direction,
                                       field)
        vectors = await self.compute(request, payloads)
        return np.stack(vectors), sum(len(p[0]) for p in payloads)

    async def score(self, request: Request, inputs: list, *, truncate, direction, field) -> np.ndarray:
        """Logits [inputs, labels] of texts and pairs."""
        self.check_count(len(inputs), field)
        payloads = await self.off_loop(self.model.prepare, inputs, self.truncating(truncate), direction, field)
        return np.stack(await self.compute(request, payloads))


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
        max_client_batch_size, auto_truncate, payload_limit, api_key, served_model_name, cuda_graphs,
        tokenization_workers).
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

    async def on_serve_error(request: Request, error: ServeError):
        service.metrics.failure(FAILURE_LABELS.get(error.status, "validation"))
        return error_response(request.url.path[len(request.scope.get("root_path", "")):], error)

    async def on_http_error(request: Request, error: HTTPException):
        if request.method == "POST":  # counted as a request by the gate
            service.metrics.failure(FAILURE_LABELS.get(error.status_code, "validation"))
        path = request.url.path[len(request.scope.get("root_path", "")):]
        message = error.detail
        if error.status_code in (404, 405):
            message = (f"no route {request.method} {path} for this {service.kind.name} model; its routes: "
                       f"{', '.join(_route_names(api))}")
        return error_response(path, ServeError(error.status_code, message))

    api.add_exception_handler(ServeError, on_serve_error)
    api.add_exception_handler(HTTPException, on_http_error)
    api.add_middleware(Gate, service=service)
    return api


def _route_names(api: FastAPI) -> list[str]:
    return [f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path}" for r in api.routes
            if getattr(r, "include_in_schema", False) and getattr(r, "methods", None)]


def _add_routes(api: FastAPI, service: Service) -> None:
    kind = service.kind.name

    def timed(route):
        """A route's duration and success counted; its errors are counted by the error handler."""
        @functools.wraps(route)
        async def run(request: Request):
            started = time.perf_counter()
            try:
                response = await route(request)
            except ClientGone:
                service.metrics.failure("disconnected")
                return Response(status_code=499)  # nobody reads it
            service.metrics.success(time.perf_counter() - started)
            return response
        return run

    async def body_of(request: Request, model_class):
        return schemas.parse(model_class, await request.body())

    async def embed_response(request: Request, body: schemas.EmbedRequest):
        vectors, _ = await service.embed(request, body.inputs, prompt_name=body.prompt_name, task=body.task,
                                         truncate=body.truncate, direction=body.truncation_direction,
                                         field="inputs", dimensions=body.dimensions)
        return _JSON([v.tolist() for v in _finish(vectors, body.dimensions, body.normalize)])

    async def rerank_response(request: Request, body: schemas.RerankRequest):
        logits = await service.score(request, [(body.query, t) for t in body.texts], truncate=body.truncate,
                                     direction=body.truncation_direction, field="texts")
        scores = logits[:, 0] if body.raw_scores else sigmoid(logits[:, 0])
        ranks = []
        for i in sorted(range(len(scores)), key=lambda i: -scores[i]):
            ranks.append({"index": i, "score": float(scores[i]), **({"text": body.texts[i]} if body.return_text
                                                                     else {})})
        return _JSON(ranks)

    async def predict_logits(request: Request, inputs, truncate, direction):
        single = not isinstance(inputs, list)
        items = [inputs] if single else inputs
        return single, await service.score(request, items, truncate=truncate, direction=direction, field="inputs")

    if kind == "embedding":
        @api.post("/embed", summary="TEI's /embed: one vector per input")
        @timed
        async def embed(request: Request):
            return await embed_response(request, await body_of(request, schemas.EmbedRequest))

        @api.post("/v1/embeddings", summary="OpenAI's embeddings")
        @timed
        async def openai_embeddings(request: Request):
            body = await body_of(request, schemas.OpenAIEmbeddingRequest)
            if body.model is not None and body.model not in service.model_names:
                raise ServeError(404, f"model: {body.model!r} is not served here (this server serves "
                                      f"{service.name!r})", param="model", code="model_not_found")
            vectors, tokens = await service.embed(request, body.input, prompt_name=body.prompt_name,
                                                  task=body.task, truncate=None, direction="right", field="input",
                                                  dimensions=body.dimensions)
            vectors = _finish(vectors, body.dimensions, service.model.normalize)
            if body.encoding_format == "base64":
                data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
            else:
                data = [v.tolist() for v in vectors]
            return _JSON({"object": "list", "model": service.name,
                          "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

        @api.post("/", summary="TEI's root: as /embed (huggingface_hub's feature_extraction posts here)")
        @timed
        async def root(request: Request):
            return await embed_response(request, await body_of(request, schemas.EmbedRequest))
    else:
        labels = service.kind.labels

        @api.post("/predict", summary="TEI's /predict: labels and scores per text or pair")
        @timed
        async def predict(request: Request):
            body = await body_of(request, schemas.PredictRequest)
            single, logits = await predict_logits(request, body.inputs, body.truncate, body.truncation_direction)
            how = _activation(labels, body.raw_scores)
            predictions = [_predictions(row, labels, how) for row in logits]
            return _JSON(predictions[0] if single else predictions)

        if kind == "reranker":
            @api.post("/rerank", summary="TEI's /rerank: texts scored against a query, best first")
            @timed
            async def rerank(request: Request):
                return await rerank_response(request, await body_of(request, schemas.RerankRequest))

        @api.post("/", summary="the Inference API's text classification (InferenceClient.text_classification); "
                               "a reranker also takes /rerank's body")
        @timed
        async def root(request: Request):
            data = schemas.load_json(await request.body())
            if kind == "reranker" and "query" in data:
                return await rerank_response(request, schemas.validate(schemas.RerankRequest, data))
            body = schemas.validate(schemas.TextClassificationRequest, data)
            parameters = body.parameters or schemas.ClassificationParameters()
            single, logits = await predict_logits(request, body.inputs, None, "right")
            how = parameters.function_to_apply or _activation(labels, False)
            predictions = [_predictions(row, labels, how)[:parameters.top_k] for row in logits]
            return _JSON(predictions)  # a list per input, a single input's too, as the Inference API answers

    @api.post("/tokenize", summary="TEI's /tokenize: the tokens of each input")
    @timed
    async def tokenize(request: Request):
        body = await body_of(request, schemas.TokenizeRequest)
        service.check_count(len(body.inputs), "inputs")
        model = service.model
        prompt = model.prompt(body.prompt_name, None) if kind == "embedding" else ""
        if kind != "embedding" and body.prompt_name is not None:
            raise ServeError(422, "prompt_name: this model has no prompts", param="prompt_name")
        return _JSON(await service.off_loop(_tokens, model, [prompt + t for t in body.inputs],
                                            body.add_special_tokens))

    @api.get("/info", summary="the model and the server's limits")
    async def info():
        model = service.model
        if kind == "embedding":
            pipeline = model.encoder.pipeline if model is not None else None
            model_type = {"embedding": {"pooling": "+".join(pipeline.pooling) if pipeline else None}}
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
            "tasks": list(model.tasks) if model is not None and kind == "embedding" else None})

    @api.get("/health", summary="200 when the model answers; 503 while it loads, after it failed, or while draining")
    async def health():
        if service.ready:
            return Response(status_code=200)
        return error_response("/health", ServeError(503, service.unready_reason()))

    @api.get("/metrics", summary="Prometheus metrics, under TEI's names")
    async def metrics():
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    @api.get("/v1/models", summary="OpenAI's model list: the one model served")
    async def openai_models():
        return _JSON({"object": "list", "data": [{"id": service.name, "object": "model", "created": service.created,
                                                  "owned_by": "fastbert"}]})


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
