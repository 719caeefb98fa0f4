"""The server as a Ray Serve deployment: replicas of the same app (fastbert/serve/server.py) behind Ray Serve's HTTP
proxy, one model on one device per replica, each running its own scheduler, so every replica batches the texts it
is sent padding-free as the single process does.

    python -m fastbert serve MODEL --ray [ADDRESS] [--replicas N | --min-replicas A --max-replicas B]
    fastbert.serve.ray.deployment(MODEL, replicas=N, **options)   -> a Ray Serve Application, for serve.run
    fastbert.serve.ray.Server                                     -> the Deployment itself, to compose with others

Ray Serve does the rest: a proxy on every node that holds a replica, routing each request to the Front deployment,
which hands it to a Server replica with room for it (and to another if that replica dies), autoscaling on the
requests ongoing per replica, health checks (check_health below) and replacing a replica that dies. The only
module of fastbert that imports ray.serve (pip install 'fastbert-triton[ray,serve]'). docs/serve.md: what happens
to a request whose replica dies, and what each replica holds.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import fields
from typing import Optional

import ray
from ray import serve

from .options import DEFAULT_TARGET_ONGOING_REQUESTS, Options
from .server import app as build_app

APP_NAME = "fastbert"
# How long a stopping replica may take to answer the requests it holds before Ray Serve kills it (the single process
# waits without a limit; a full one-thread CPU replica holds 512 requests of up to 16 texts: ~100 s at ~11 ms a
# text).
DRAIN_TIMEOUT_S = 600.0


@serve.deployment(name="Server", max_ongoing_requests=Options.max_concurrent_requests,
                  graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S)
@serve.ingress()
class Server:
    """One replica: `fastbert.serve.app(model, **options)` (its routes, scheduler, gate and metrics) on one device.

    threads: torch's CPU threads in this replica (its CPUs, on a CPU replica); log_level: the replica's fastbert.serve
    log lines. The app's lifespan starts when the replica starts, and the replica counts as started only once the
    model is loaded, so Ray Serve routes nothing to a replica still loading; a model that cannot load fails the
    replica, with the reason in its log."""

    def __init__(self, model=None, threads: Optional[int] = None, log_level: str = "info", **options):
        if threads:
            import torch
            torch.set_num_threads(threads)
        log = logging.getLogger("fastbert.serve")
        if not log.handlers:  # beside Ray's own lines in the replica's log
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)-9s %(message)s"))
            log.addHandler(handler)
        log.setLevel(log_level.upper())
        self._model, self._options, self._service = model, options, None

    def __serve_build_asgi_app__(self):
        api = self._api = build_app(self._model, **self._options)
        self._service = api.state.service
        self._service.load_before_serving = True
        return api

    async def _run_asgi_lifespan_startup(self):
        # Ray Serve's ingress wrapper runs the app's lifespan startup here and, when it fails, raises a RuntimeError
        # that only points at the replica's log; the reason, raised instead, reaches the deployment's status message
        # and so `serve.run`'s caller (the CLI prints it). Were Ray to rename this step, its own message would stand.
        try:
            await super()._run_asgi_lifespan_startup()
        except RuntimeError:
            if self._service is not None and self._service.state == "failed":
                raise RuntimeError(f"the model failed to load: {self._service.error}") from None
            raise

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes) -> tuple:
        """One HTTP request through this replica's app, in process (the front's way in) -> (status, raw headers,
        body)."""
        import asyncio
        sent, messages = False, []

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves: the front holds its connection

        async def send(message):
            messages.append(message)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
                 "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
        await self._api(scope, receive, send)
        start = next(m for m in messages if m["type"] == "http.response.start")
        return start["status"], list(start.get("headers", [])), b"".join(
            m.get("body", b"") for m in messages if m["type"] == "http.response.body")

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose model worker stopped is replaced (while draining, it is
        stopping anyway)."""
        service = self._service
        if service is not None and service.state == "ready" and not service.ready:
            raise RuntimeError(f"pid {os.getpid()}: {service.unready_reason()}")


# A request whose replica died is sent again, to another replica, this many times (every request is idempotent)
RETRIES = 3


@serve.deployment(name="Front", max_ongoing_requests=1_000_000, max_queued_requests=-1,
                  ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S)
class Front:
    """What Ray Serve's proxy routes to: each HTTP request, whole, handed to a Server replica through a deployment
    handle; a request whose replica dies on the way (its actor lost) is handed to another, up to RETRIES times, so a
    dying replica costs its requests a retry, not an error. Every route is idempotent (embed, rerank, classify,
    tokenize, read), so sending one again is always safe. Past the replicas' room: 429, as the proxy answers."""

    def __init__(self, server):
        self._server = server

    async def __call__(self, request):
        import asyncio

        from ray.serve.exceptions import BackPressureError
        from starlette.responses import Response
        body = await request.body()
        call = (request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body)
        for attempt in range(RETRIES + 1):
            try:
                status, headers, answer = await self._server.forward.remote(*call)
                break
            except BackPressureError:
                return Response("the replicas are at their limit of requests in flight; retry later", 429)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                if attempt == RETRIES:
                    return Response(f"the request's replica was lost {RETRIES + 1} times", 503)
                await asyncio.sleep(0.2 * (attempt + 1))  # the router learns the replica is gone
        response = Response(answer, status)
        response.raw_headers = headers + ([(b"x-fastbert-retries", b"%d" % attempt)] if attempt else [])
        return response


def deployment(model=None, *, replicas: Optional[int] = None, min_replicas: Optional[int] = None,
               max_replicas: Optional[int] = None, target_ongoing_requests: float = DEFAULT_TARGET_ONGOING_REQUESTS,
               gpus_per_replica: Optional[float] = None, cpus_per_replica: float = 1, log_level: str = "info",
               **options) -> "serve.Application":
    """The server as a Ray Serve application: serve.run(deployment("FOLDER", replicas=2), route_prefix="/").

    model, options: as fastbert.serve.app (device, dtype, kernels, max_batch_tokens, max_concurrent_requests, ...),
        applied in every replica. device: "cuda" or "cpu" (a replica sees only its own GPU: no index); None: cuda
        where gpus_per_replica > 0, else cpu.
    replicas: a fixed number of replicas (default 1); or min_replicas and max_replicas: Ray Serve's autoscaler keeps
        the count between them, aiming at target_ongoing_requests requests in flight per replica.
    gpus_per_replica: GPUs reserved per replica (default: 1, or 0 with device="cpu"; 0.5 puts two replicas on a GPU);
        cpus_per_replica: CPUs reserved per replica (default 1), which are also its torch threads on a CPU replica.
    Each replica takes up to max_concurrent_requests requests at once (Ray Serve's max_ongoing_requests), and each
    proxy holds at most as many more waiting for a replica; past that, 429 at once, as the single process answers."""
    settings, init = _settings(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                               target_ongoing_requests=target_ongoing_requests, gpus_per_replica=gpus_per_replica,
                               cpus_per_replica=cpus_per_replica, options=options)
    return Front.bind(Server.options(**settings).bind(model, log_level=log_level, **init))


def _settings(*, replicas, min_replicas, max_replicas, target_ongoing_requests, gpus_per_replica, cpus_per_replica,
              options: dict) -> tuple:
    """deployment()'s arguments, checked -> (Ray Serve's options for Server, the replicas' constructor keywords)."""
    known = {f.name for f in fields(Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known))}")
    checked = Options(**options)  # the app's own checks, here rather than in every replica
    device = checked.device
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device={device!r}: a replica runs on 'cpu' or 'cuda' (each replica sees only the GPU Ray "
                         f"gives it, as cuda:0)")
    if gpus_per_replica is None:
        gpus_per_replica = 0 if device == "cpu" else 1
    if isinstance(gpus_per_replica, bool) or not isinstance(gpus_per_replica, (int, float)) or gpus_per_replica < 0:
        raise ValueError(f"gpus_per_replica must be a number >= 0, got {gpus_per_replica!r}")
    if device == "cpu" and gpus_per_replica:
        raise ValueError(f"gpus_per_replica={gpus_per_replica} with device='cpu'")
    if device == "cuda" and not gpus_per_replica:
        raise ValueError("device='cuda' needs gpus_per_replica > 0 (Ray gives a replica only the GPUs it reserves)")
    if isinstance(cpus_per_replica, bool) or not isinstance(cpus_per_replica, (int, float)) or \
            not cpus_per_replica > 0:
        raise ValueError(f"cpus_per_replica must be a number > 0, got {cpus_per_replica!r}")
    device = device or ("cuda" if gpus_per_replica else "cpu")
    actor = {"num_cpus": cpus_per_replica, **({"num_gpus": gpus_per_replica} if gpus_per_replica else {})}
    limit = checked.max_concurrent_requests
    settings = {"ray_actor_options": actor, "max_ongoing_requests": limit, "max_queued_requests": limit,
                "backpressure_config": {"status_code": 429},
                **_scaling(replicas, min_replicas, max_replicas, target_ongoing_requests)}
    threads = max(1, int(cpus_per_replica)) if device == "cpu" else None
    return settings, {**options, "device": device, "threads": threads}


def _scaling(replicas, min_replicas, max_replicas, target) -> dict:
    """Ray Serve's num_replicas, or its autoscaling_config."""
    def positive(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if min_replicas is None and max_replicas is None:
        replicas = 1 if replicas is None else replicas
        positive("replicas", replicas)
        return {"num_replicas": replicas}
    if replicas is not None:
        raise ValueError("give replicas (a fixed count) or min_replicas and max_replicas (autoscaling), not both")
    if min_replicas is None or max_replicas is None:
        raise ValueError("autoscaling needs both min_replicas and max_replicas")
    positive("min_replicas", min_replicas)
    positive("max_replicas", max_replicas)
    if min_replicas > max_replicas:
        raise ValueError(f"min_replicas {min_replicas} is more than max_replicas {max_replicas}")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not target > 0:
        raise ValueError(f"target_ongoing_requests must be a number > 0, got {target!r}")
    return {"autoscaling_config": {"min_replicas": min_replicas, "max_replicas": max_replicas,
                                   "initial_replicas": min_replicas, "target_ongoing_requests": target}}


# ---- what `python -m fastbert serve --ray` does with it -------------------------------------------------------------
class DeploymentFailed(Exception):
    """The application could not start: its message is the reason (the model's own error where a replica gave one)."""


def serve_running() -> bool:
    """Ray Serve already runs on the connected cluster (its proxies keep the host and port they started with)."""
    return bool(serve.status().proxies)


@contextlib.contextmanager
def deployed(application, *, host: str, port: int):
    """`application` deployed as APP_NAME behind Ray Serve's proxies on host:port (applied when Ray Serve starts on
    the cluster), yielding once every replica has loaded its model; deleted on the way out, however it is left: Ray
    Serve then stops routing to the replicas, each answers the requests it holds and its model worker finishes its
    queue (the app's lifespan), and the replica stops. DeploymentFailed when a replica cannot start."""
    if APP_NAME in serve.status().applications:
        raise ValueError(f"a Ray Serve application named {APP_NAME!r} already runs on this cluster (another "
                         f"`fastbert serve --ray`?): deploying would replace it")
    try:
        serve.start(http_options={"host": host, "port": port})
    except ray.exceptions.RayError as e:  # a proxy could not start (its port taken, on some node)
        raise DeploymentFailed(f"Ray Serve's HTTP proxy could not start on {host}:{port}: "
                               f"{getattr(e, 'cause', None) or e}") from None
    try:
        try:
            serve.run(application, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # serve.run's answer to a deployment that failed
            raise DeploymentFailed(_failure(e)) from None
        yield
    finally:
        serve.delete(APP_NAME)


def _failure(error: Exception) -> str:
    """Why the deployment failed, in one line: the model's own error where a replica reported one (the last line of
    the deployment's status message, Ray Serve's traceback of the replica's start), else Ray Serve's."""
    try:
        message = serve.status().applications[APP_NAME].deployments["Server"].message
    except Exception:  # noqa: BLE001 - the status is a courtesy; Ray Serve's own error stands
        message = ""
    reasons = [line.split("RuntimeError: ", 1)[1] for line in message.splitlines()
               if line.startswith("RuntimeError: the model failed to load: ")]
    return reasons[-1] if reasons else f"the deployment failed: {' '.join(str(error).split())}"
