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
# te_request_failure's `err` label per status, where a raise site names none (TEI's kinds; a refusal for a key or
# while the server is not ready is not a failure of the request's, and is not counted)
FAILURE_LABELS = {400: "validation", 404: "validation", 405: "validation", 413: "validation", 422: "validation",
                  424: "inference", 429: "overloaded"}


class ServeError(Exception):
    """A request that cannot be answered: its kind (the subclass) carries the HTTP status and te_request_failure's
    `err` label; message names the field or the limit. param: the request field at fault (OpenAI's `param`); code:
    OpenAI's `code`; label: `err` where the raise site knows better than the kind (a 413 for too many inputs is
    "batch_size", for a long input "tokenization")."""

    status = 400

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, label: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.headers = headers or {}
        self.label = label if label is not None else FAILURE_LABELS.get(self.status)

    @staticmethod
    def of_status(status: int, message: str) -> "ServeError":
        """An error of the kind that answers `status` (a status no kind has: a ServeError answering it)."""
        kind = next((k for k in KINDS if k.status == status), None)
        if kind is not None:
            return kind(message)
        error = ServeError.__new__(ServeError)
        error.status = status
        ServeError.__init__(error, message)
        return error


class Invalid(ServeError):
    """Broken JSON, a missing field, a wrong type, an unknown prompt or task, a bad token id."""
    status = 422


class TooLarge(ServeError):
    """Too many inputs, an input past the model's limit, a body past the payload limit."""
    status = 413


class Unauthorized(ServeError):
    """No key or a wrong key."""
    status = 401


class NotServed(ServeError):
    """A `model` refused, a route this kind does not answer."""
    status = 404


class Overloaded(ServeError):
    """More requests in flight than the limit."""
    status = 429


class BackendFailed(ServeError):
    """The model raised on the batch."""
    status = 424


class Unavailable(ServeError):
    """Loading, failed to load, draining, or the worker stopped."""
    status = 503


KINDS = (Invalid, TooLarge, Unauthorized, NotServed, Overloaded, BackendFailed, Unavailable)


def is_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def is_cohere(path: str) -> bool:
    return path == "/v2" or path.startswith("/v2/")


def error_response(path: str, error: ServeError) -> JSONResponse:
    """The body of `error` as the route's API shapes it: OpenAI's under /v1 (Jina's /v1/rerank too), Cohere's under
    /v2, TEI's elsewhere."""
    if is_cohere(path):
        body = {"message": error.message}
    elif is_openai(path):
        body = {"error": {"message": error.message, "type": OPENAI_TYPES.get(error.status, "invalid_request_error"),
                          "param": error.param, "code": error.code}}
    else:
        body = {"error": error.message, "error_type": ERROR_TYPES.get(error.status, "Validation")}
    return JSONResponse(body, status_code=error.status, headers=error.headers)
