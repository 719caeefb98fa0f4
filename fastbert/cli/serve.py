"""python -m fastbert serve [MODEL] [options]: the embedding, reranking and classification server (fastbert/serve)
under uvicorn, with text-embeddings-inference's option names and defaults where TEI has them.

The command owns the process's signals (the app never does): SIGTERM or Ctrl-C stops accepting, /health turns 503,
every accepted request is answered, the model worker finishes the queue, and the process exits 0. A model that fails
to load stops the server with a one-line error and exit code 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from .common import DTYPES, Parser, UsageError, count, device_of, parse_kernels

EPILOG = """examples:
  python -m fastbert serve                                  the bundled all-MiniLM-L6-v2 on 127.0.0.1:8080
  python -m fastbert serve ./my-reranker --port 9000        a *ForSequenceClassification folder with one label
  python -m fastbert serve ./bge --device cuda --dtype bfloat16 --host 0.0.0.0 --api-key "$KEY"

  curl 127.0.0.1:8080/embed -H 'Content-Type: application/json' -d '{"inputs": ["What is Deep Learning?"]}'
"""


def serve_parser() -> Parser:
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
    net.add_argument("--served-model-name", metavar="NAME", help="the model's name on /v1 (default: the folder's "
                     "name)")
    net.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                     help="uvicorn's and the server's log level; debug logs one line per batch (default: info)")
    model = parser.add_argument_group("model")
    model.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    model.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="the model's dtype (default: what the "
                       "folder says, else the checkpoint's own); pooling runs in fp32")
    model.add_argument("--kernels", type=parse_kernels, default="auto",
                       help="auto (default), torch, triton, or op=backend,...")
    model.add_argument("--no-cuda-graphs", action="store_true",
                       help="run the model eagerly on CUDA too (by default it replays CUDA graphs over token buckets)")
    limits = parser.add_argument_group("batching and limits")
    limits.add_argument("--max-batch-tokens", type=count(1), default=16384, metavar="N",
                        help="real tokens per batch the model worker runs (no padding is computed; default: 16384)")
    limits.add_argument("--max-concurrent-requests", type=count(1), default=512, metavar="N",
                        help="requests in flight; the next one is refused at once with 429 (default: 512)")
    limits.add_argument("--max-client-batch-size", type=count(1), default=32, metavar="N",
                        help="inputs per request; more is a 413 (default: 32)")
    limits.add_argument("--auto-truncate", action="store_true",
                        help="cut an input past the model's limit (at the end a request's truncation_direction names) "
                        "when the request does not say (/v1/embeddings has no say); without it, such an input is a 413")
    limits.add_argument("--payload-limit", type=count(1), default=2_000_000, metavar="BYTES",
                        help="request body size; more is a 413 (default: 2000000)")
    limits.add_argument("--tokenization-workers", type=count(1), default=None, metavar="N",
                        help="threads that tokenize (default: min(4, CPUs))")
    return parser


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
    device = device_of(args)
    asgi = app(args.model or args.model_option, device=str(device), dtype=args.dtype, kernels=args.kernels,
               max_batch_tokens=args.max_batch_tokens, max_concurrent_requests=args.max_concurrent_requests,
               max_client_batch_size=args.max_client_batch_size, auto_truncate=args.auto_truncate,
               payload_limit=args.payload_limit,
               api_key=args.api_key, served_model_name=args.served_model_name, cuda_graphs=not args.no_cuda_graphs,
               tokenization_workers=args.tokenization_workers)
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
