"""What every request passes before a route sees it (a plain ASGI middleware, so it runs before the body is read):

    1. the API key, when the server has one: `Authorization: Bearer KEY`, compared in constant time (hmac), never
       logged; every route but GET /health (a load balancer's probe holds no key) -> else 401
    2. POST routes (the work): the model must be ready (not loading, failed or draining)              -> else 503
    3. a declared body (Content-Length) over the payload limit                                        -> 413 at once
    4. at most max_concurrent_requests POSTs in flight; the next one is refused at once, never queued  -> 429
    5. a body that streams past the payload limit without declaring its length: 413 when the route reads it
"""
from __future__ import annotations

import hmac

from starlette.datastructures import Headers

from .errors import Overloaded, ServeError, TooLarge, Unauthorized, Unavailable, error_response


def _route_path(scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class Gate:
    def __init__(self, app, service):
        self.app, self.service = app, service
        key = service.options.api_key
        self._key = None if key is None else f"Bearer {key}".encode()

    def _authorized(self, headers: Headers) -> bool:
        given = headers.get("authorization", "").encode()
        return hmac.compare_digest(given, self._key)

    async def _refuse(self, scope, receive, send, error: ServeError, counted: bool) -> None:
        """counted: te_request_count (with no method: its inputs were never read) and te_request_failure, for an
        inference route; te_request_failure only for /tokenize, as TEI counts it."""
        path, metrics = _route_path(scope), self.service.metrics
        if counted and error.label is not None:  # a 503 (not ready, draining) is not counted, as TEI serves none
            if path in self.service.counted_paths:
                metrics.request(None)
            if path in self.service.counted_paths or path == "/tokenize":
                metrics.failure(error.label)
        await error_response(path, error)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        service, path = self.service, _route_path(scope)
        headers = Headers(scope=scope)
        if self._key is not None and not (path == "/health" and scope["method"] in ("GET", "HEAD")) \
                and not self._authorized(headers):
            given = "no Authorization header" if "authorization" not in headers else "a wrong key"
            return await self._refuse(scope, receive, send, Unauthorized(
                f"this server needs an API key (Authorization: Bearer KEY); the request sent {given}",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}), counted=False)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)

        if not service.ready:
            return await self._refuse(scope, receive, send, Unavailable(service.unready_reason()), True)
        limit = service.options.payload_limit
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, TooLarge(
                f"body: {int(declared):,} bytes, more than the payload limit of {limit:,} bytes",
                param="body"), True)
        if service.in_flight >= service.options.max_concurrent_requests:
            return await self._refuse(scope, receive, send, Overloaded(
                f"the server is at its limit of {service.options.max_concurrent_requests} requests in flight; "
                     f"retry later"), True)

        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise TooLarge(f"body: more than the payload limit of {limit:,} bytes", param="body")
            return message

        service.in_flight += 1
        try:
            await self.app(scope, receive_within_limit, send)
        finally:
            service.in_flight -= 1

