"""fastbert.serve: an embedding, reranking and classification server over HTTP (TEI's and OpenAI's APIs) that
gathers every client's texts into padding-free batches.

    python -m fastbert serve [MODEL] [--port 8080] [...]        the command (fastbert/cli/serve.py)
    fastbert.serve.app(model=FOLDER, **options)                   the ASGI app, for uvicorn, gunicorn or Ray Serve
    python -m fastbert serve MODEL --ray [ADDRESS] [...]         the app as replicas on a Ray cluster
    fastbert.serve.ray.deployment(FOLDER, replicas=N, ...)        the same, for serve.run (fastbert/serve/ray.py,
                                                                  imported only when asked for: it needs Ray Serve)

Needs the `serve` extra (FastAPI, uvicorn): pip install "fastbert-triton[serve]". The rest of
fastbert never imports this package. docs/serve.md: the routes, the options, the scheduler, the numbers.
"""
from .options import Options

__all__ = ["app", "Options"]


def __getattr__(name):
    """`app` imports the server (FastAPI) when first asked for; Options needs none of it (the command's parser)."""
    if name == "app":
        from .server import app
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
