"""python -m fastbert serve [MODEL] [options]: the embedding, reranking and classification server (fastbert/serve)
under uvicorn, with text-embeddings-inference's option names and defaults where TEI has them.

The command owns the process's signals (the app never does): SIGTERM or Ctrl-C stops accepting, /health turns 503,
every accepted request is answered, the model worker finishes the queue, and the process exits 0. A model that fails
to load stops the server with a one-line error and exit code 1.

With --ray, the same app runs as replicas of a Ray Serve deployment (fastbert/serve/ray.py) behind Ray Serve's HTTP
proxy on --host/--port; this process deploys it, waits, and on SIGTERM or Ctrl-C deletes it, which drains every
replica (each answers the requests it holds, then its worker finishes its queue) before the process exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading

from .common import (
    DTYPES,
    Parser,
    UsageError,
    add_format_options,
    add_ray_address,
    count,
    default_model,
    device_of,
    fraction,
    parse_kernels,
)

EPILOG = """examples:
  python -m fastbert serve                                  the bundled all-MiniLM-L6-v2 on 127.0.0.1:8080
  python -m fastbert serve ./my-reranker --port 9000        a *ForSequenceClassification folder with one label
  python -m fastbert serve ./bge --device cuda --dtype bfloat16 --host 0.0.0.0 --api-key "$KEY"
  python -m fastbert serve /shared/bge --ray auto --min-replicas 1 --max-replicas 8 --dtype bfloat16
                                                            replicas on a Ray cluster, one per GPU, autoscaled

  curl 127.0.0.1:8080/embed -H 'Content-Type: application/json' -d '{"inputs": ["What is Deep Learning?"]}'
"""


def serve_parser() -> Parser:
    from ..serve.options import DEFAULT_TARGET_ONGOING_REQUESTS, default

    parser = Parser(prog="python -m fastbert serve", description="An embedding, reranking and classification "
                    "server (TEI's and OpenAI's HTTP APIs) that batches every client's texts padding-free.",
                    epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", metavar="MODEL", help="a sentence-transformers or plain encoder folder "
                        "(embeddings), a *ForSequenceClassification folder with one label (reranker) or several "
                        "(classifier), or a Hub id in the local cache (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="the same as MODEL")
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1, this "
                     "machine only; 0.0.0.0 exposes the server to the network)")
    net.add_argument("--port", type=count(0), default=8080, help="the port (default: 8080; 0: any free port, "
                     "printed when listening)")
    net.add_argument("--api-key", metavar="KEY", default=os.environ.get("FASTBERT_API_KEY"),
                     help="require 'Authorization: Bearer KEY' on every route but GET /health (default: the "
                     "FASTBERT_API_KEY environment variable, which keeps the key off the process list; none: open)")
    net.add_argument("--served-model-name", metavar="NAME", help="the model's name on /v1/models, /info and in "
                     "answers (default: a cached Hub folder's repo id; a sentence-transformers folder's name as its "
                     "model card gives it, the bundled model's all-MiniLM-L6-v2; else the folder's name)")
    net.add_argument("--strict-model-name", action="store_true", help="refuse (404) a /v1 request whose `model` is "
                     "not the served name (by default, as TEI, any `model` is answered by the one model served)")
    net.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                     help="uvicorn's and the server's log level; debug logs one line per batch (default: info)")
    model = parser.add_argument_group("model")
    model.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    model.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the model's dtype (default: what the "
                       "folder says, else the checkpoint's own); pooling runs in fp32")
    model.add_argument("--kernels", type=parse_kernels, default=default("kernels"),
                       help=f"auto, torch, triton, or op=backend,... (default: {default('kernels')})")
    add_format_options(model)
    model.add_argument("--no-cuda-graphs", action="store_true",
                       help="run the model eagerly on CUDA too (by default it replays CUDA graphs over token buckets)")
    limits = parser.add_argument_group("batching and limits")
    limits.add_argument("--max-batch-tokens", type=count(1), default=default("max_batch_tokens"), metavar="N",
                        help=f"real tokens per batch the model worker runs (no padding is computed; on a CPU in "
                             f"forwards of at most 4,096; default: {default('max_batch_tokens')})")
    limits.add_argument("--max-concurrent-requests", type=count(1), default=default("max_concurrent_requests"),
                        metavar="N", help=f"requests in flight; the next one is refused at once with 429 (default: "
                                          f"{default('max_concurrent_requests')})")
    limits.add_argument("--max-client-batch-size", type=count(1), default=default("max_client_batch_size"),
                        metavar="N", help=f"inputs per request; more is a 413 (default: "
                                          f"{default('max_client_batch_size')})")
    limits.add_argument("--auto-truncate", action="store_true",
                        help="cut an input past the model's limit (at the end a request's truncation_direction names) "
                        "when the request does not say (/v1/embeddings has no say); without it, such an input is a 413")
    limits.add_argument("--payload-limit", type=count(1), default=default("payload_limit"), metavar="BYTES",
                        help=f"request body size; more is a 413 (default: {default('payload_limit')})")
    limits.add_argument("--tokenization-workers", type=count(1), default=default("tokenization_workers"), metavar="N",
                        help="threads that tokenize (default: min(4, CPUs))")
    ray = parser.add_argument_group(
        "Ray: replicas behind one endpoint (pip install 'fastbert-triton[ray,serve]')",
        "Each replica holds the model on one device and batches its own requests; Ray Serve's proxy on every node "
        "listens on --host/--port and routes each request to a replica. The model folder must be readable at the "
        "same path on every node.")
    add_ray_address(ray, "serve as a Ray Serve deployment")
    ray.add_argument("--replicas", type=count(1), metavar="N",
                     help="a fixed number of replicas (default: one per GPU in the cluster; without GPUs, its CPUs / "
                          "--cpus-per-replica)")
    ray.add_argument("--min-replicas", type=count(1), metavar="N", help="autoscale between --min-replicas and "
                     "--max-replicas on the requests in flight per replica (Ray Serve's autoscaler)")
    ray.add_argument("--max-replicas", type=count(1), metavar="N", help="see --min-replicas")
    ray.add_argument("--target-ongoing-requests", type=fraction, metavar="N", default=None,
                     help="with --min/--max-replicas: the requests in flight per replica the autoscaler aims at "
                          f"(default: {DEFAULT_TARGET_ONGOING_REQUESTS}, which keeps a replica's batches full)")
    ray.add_argument("--gpus-per-replica", type=fraction, metavar="X",
                     help="GPUs per replica (default 1 where the cluster has GPUs; 0.5 puts two replicas on a GPU)")
    ray.add_argument("--cpus-per-replica", type=fraction, metavar="X",
                     help="CPUs per replica (default 1; on a CPU replica they are its torch threads)")
    return parser


def app_options(args, device) -> dict:
    """fastbert.serve.Options' fields from the parsed flags: each flag is named as its field (--max-batch-tokens:
    max_batch_tokens), but --no-cuda-graphs (cuda_graphs) and the device, given. The one place the command maps its
    flags onto the app, for one process and for every Ray replica alike."""
    from ..serve.options import Options
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(Options)
              if f.name not in ("device", "cuda_graphs")}
    return {**values, "device": device, "cuda_graphs": not args.no_cuda_graphs}


RAY_ONLY = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "gpus_per_replica",
            "cpus_per_replica")


def _server(config, service):
    """uvicorn's Server, with /health turning 503 the moment a stop signal arrives (uvicorn then stops accepting and
    waits for the requests in flight)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            service.drain()
            super().handle_exit(sig, frame)
    return DrainingServer(config)


def _ignore(signum, frame):
    pass


def serve(args) -> int:
    try:
        import uvicorn

        from ..serve import app
    except ImportError as e:
        raise UsageError(f"python -m fastbert serve needs the serve extra ({e.name} is missing): "
                         f"pip install 'fastbert-triton[serve]'") from None
    if args.model and args.model_option and args.model != args.model_option:
        raise UsageError(f"two models given: {args.model!r} and --model {args.model_option!r}")
    if args.ray is not None:
        return serve_on_ray(args)
    given = [f"--{name.replace('_', '-')}" for name in RAY_ONLY if getattr(args, name) is not None]
    if given:
        raise UsageError(f"{given[0]} is an option of --ray (replicas of the server on a Ray cluster)")
    device = device_of(args)
    asgi = app(args.model or args.model_option, **app_options(args, device=str(device)))
    service = asgi.state.service

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    host, port = sock.getsockname()[:2]

    log = logging.getLogger("fastbert.serve")  # beside uvicorn's lines, in their format
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)-9s %(message)s"))
    log.addHandler(handler)
    log.setLevel(args.log_level.upper())
    config = uvicorn.Config(asgi, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=None)
    server = _server(config, service)
    failure = []

    def on_failure(message):
        failure.append(message)
        server.should_exit = True
    service.on_failure = on_failure

    print(f"fastbert serve: {service.kind.name} model {service.name} on http://{host}:{port} (loading; GET "
          f"/health answers 200 when ready)", file=sys.stderr, flush=True)
    # uvicorn puts back the handlers it found and raises the signal that stopped it once it is done; a handler that
    # does nothing lets the command end with its own exit code (0 after a clean drain)
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if failure:
        print(f"python -m fastbert serve: error: the model failed to load: {failure[0]}", file=sys.stderr)
        return 1
    return 0


class _Stop(Exception):
    """SIGTERM or Ctrl-C while the deployment starts or serves."""


def _check_ray_options(args) -> None:
    if args.replicas is not None and (args.min_replicas is not None or args.max_replicas is not None):
        raise UsageError("give --replicas (a fixed count) or --min-replicas and --max-replicas (autoscaling), not both")
    if (args.min_replicas is None) != (args.max_replicas is None):
        raise UsageError("autoscaling needs both --min-replicas and --max-replicas")
    if args.min_replicas is not None and args.min_replicas > args.max_replicas:
        raise UsageError(f"--min-replicas {args.min_replicas} is more than --max-replicas {args.max_replicas}")
    if args.target_ongoing_requests is not None and args.min_replicas is None:
        raise UsageError("--target-ongoing-requests is for autoscaling (--min-replicas and --max-replicas)")
    if args.device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device {args.device!r}: with --ray a replica runs on cpu or cuda (each sees only the "
                         f"GPU Ray gives it)")
    if args.device == "cpu" and args.gpus_per_replica:
        raise UsageError("--gpus-per-replica is for --device cuda")


def serve_on_ray(args) -> int:
    """--ray: the app as a Ray Serve deployment behind Ray Serve's proxy, until SIGTERM or Ctrl-C."""
    try:
        from ..distributed.cluster import connected
        from ..serve import ray as on_ray
        from ..serve.models import read_kind
    except ImportError as e:
        raise UsageError(f"--ray needs Ray Serve and the serve extra ({e.name} is missing): "
                         f"pip install 'fastbert-triton[ray,serve]'") from None
    _check_ray_options(args)
    model = args.model or args.model_option
    read_kind(model if model is not None else default_model())  # a bad folder: one line, before any cluster
    port = args.port or _free_port(args.host)
    with connected(args.ray or None, log_to_driver=args.log_level == "debug") as resources:
        replicas, gpus, cpus = replica_plan(args, resources)
        application = on_ray.deployment(
            model, replicas=replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests or on_ray.DEFAULT_TARGET_ONGOING_REQUESTS,
            gpus_per_replica=gpus, cpus_per_replica=cpus, log_level=args.log_level,
            **app_options(args, device=args.device))
        scale = f"{replicas} replica(s)" if replicas else f"{args.min_replicas} to {args.max_replicas} replicas"
        if on_ray.serve_running():
            print("fastbert serve: Ray Serve already runs on this cluster: its proxies keep the host and port they "
                  "started with (--host/--port apply when Ray Serve starts)", file=sys.stderr, flush=True)
        else:
            _check_free(args.host, port)  # the proxy on this node will bind it
        print(f"fastbert serve: deploying {scale} ({gpus:g} GPU and {cpus:g} CPU each) on Ray", file=sys.stderr,
              flush=True)
        stop = threading.Event()

        def on_signal(signum, frame):
            if not stop.is_set():  # the first signal stops; a second must not cut the drain short
                stop.set()
                raise _Stop()
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            with on_ray.deployed(application, host=args.host, port=port):
                print(f"fastbert serve: model ready on http://{args.host}:{port} (Ray Serve application "
                      f"{on_ray.APP_NAME!r}; SIGTERM or Ctrl-C drains and stops it)", file=sys.stderr, flush=True)
                while not stop.wait(1.0):
                    pass
        except _Stop:
            pass
        except on_ray.DeploymentFailed as e:
            print(f"python -m fastbert serve: error: {e}", file=sys.stderr)
            return 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print("fastbert serve: application deleted after its replicas answered every request they held",
          file=sys.stderr, flush=True)
    return 0


def replica_plan(args, resources: dict) -> tuple:
    """(replicas, GPUs per replica, CPUs per replica) for a cluster's resources (ray.cluster_resources()): a GPU per
    replica where the cluster has GPUs (unless --device cpu), one replica per GPU (or per --cpus-per-replica CPUs
    without GPUs) unless --replicas or autoscaling says; replicas is None when autoscaling."""
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1 if args.device == "cuda" or (args.device is None and resources.get("GPU", 0)) else 0
    if gpus and not resources.get("GPU", 0):
        raise UsageError("the Ray cluster has no GPU (ray.cluster_resources() lists none): --device cpu serves on "
                         "CPU replicas")
    cpus = args.cpus_per_replica or 1
    replicas = args.replicas
    if replicas is None and args.min_replicas is None:
        have = resources.get("GPU", 0) / gpus if gpus else resources.get("CPU", 0) / cpus
        replicas = max(1, int(have))
    return replicas, gpus, cpus


def _check_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None


def _free_port(host: str) -> int:
    """A port free on this machine now (--port 0 with --ray; the proxies on other nodes bind the same number)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
