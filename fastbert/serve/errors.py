"""What a request that cannot be answered gets: a status and a message naming what was wrong, in TEI's error body on
TEI's routes and in OpenAI's on /v1. Never a 5xx for a client's input; a model failure is a 424, as TEI answers it."""
from __future__ import annotations

from starlette.responses import JSONResponse

# TEI's error_type per status
ERROR_TYPES = {400: "Validation", 401: "Unauthorized", 404: "NotFound", 405: "Validation", 413: "Validation",
               422: "Validation", 424: "Backend", 429: "Overloaded", 503: "Unhealthy"}
# OpenAI's error type per status
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
                424: "server_error", 429: "rate_limit_error", 503: "server_error"}
# te_request_failure's `err` label per status
FAILURE_LABELS = {400: "validation", 401: "unauthorized", 404: "validation", 405: "validation", 413: "validation",
                  422: "validation", 424: "backend", 429: "overloaded", 503: "unhealthy"}


class ServeError(Exception):
    """A request that gets `status` and `message` (which names the field or the limit). param: the request field at
    fault (OpenAI's `param`); code: OpenAI's `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def is_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(path: str, error: ServeError) -> JSONResponse:
    """The body of `error` as the route's API shapes it: OpenAI's under /v1, TEI's elsewhere."""
    if is_openai(path):
        body = {"error": {"message": error.message, "type": OPENAI_TYPES.get(error.status, "invalid_request_error"),
                          "param": error.param, "code": error.code}}
    else:
        body = {"error": error.message, "error_type": ERROR_TYPES.get(error.status, "Validation")}
    return JSONResponse(body, status_code=error.status, headers=error.headers)
