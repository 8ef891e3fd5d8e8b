"""What an error looks like on each wire, the one place that knows: the HTTP status and body before the
first byte of a response, and the terminal event of a stream after it (REFERENCE §8). The OpenAI shape
(`{"error": {message, type, param, code}}`, with `GatewayError`'s own status) serves Chat Completions,
completions, `/generate` and the Responses API; Anthropic's (`{"type": "error", "error": {type,
message}}`) has its own statuses (529 when overloaded). Stages raise typed errors only; the route sets
its wire's stream frame on the request context (`RequestContext.error_frame`) for the stream driver.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..errors import GatewayError
from ..pipeline.sse import DONE, data_frame, event_frame
from ..surfaces.responses.events import error_event


def openai_error(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error object of `exc` (a gateway bug is an opaque internal error)."""
    if isinstance(exc, GatewayError):
        return exc.to_dict()
    return {
        "message": "internal error while streaming",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def openai_error_frame(exc: BaseException) -> bytes:
    """Chat Completions, completions and `/generate` mid-stream: `data: {"error": {...}}`, then `[DONE]`."""
    return data_frame({"error": openai_error(exc)}) + DONE


def responses_error_event(exc: BaseException, sequence_number: int) -> bytes:
    """A Responses stream's `error` event (a stream cut before its own terminal event could be made)."""
    error = openai_error(exc)
    return error_event(sequence_number, str(error["code"]), str(error["message"]), error["param"])


#: GatewayError status → (HTTP status, Anthropic error type). Anthropic answers 529 when overloaded.
_ANTHROPIC_ERRORS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    409: (409, "invalid_request_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),
    504: (504, "timeout_error"),
}


def anthropic_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Anthropic's `(status, {"type": "error", "error": {type, message}})` for `exc`."""
    if isinstance(exc, GatewayError):
        status, error_type = _ANTHROPIC_ERRORS.get(exc.status_code, (exc.status_code, "api_error"))
        if status < 400:
            status = 500
        where = f" (at {exc.param})"
        message = exc.message if exc.param is None or exc.message.endswith(where) else exc.message + where
    else:
        status, error_type, message = 500, "api_error", "internal error"
    return status, {"type": "error", "error": {"type": error_type, "message": message}}


def anthropic_error_frame(exc: BaseException) -> bytes:
    """A Messages stream's terminal `error` event."""
    return event_frame("error", anthropic_error(exc)[1])


def error_body(path: str, exc: GatewayError) -> tuple[int, bytes]:
    """The status and JSON body of `exc` answered on `path` before any byte was sent."""
    if path == "/v1/messages":
        status, body = anthropic_error(exc)
        return status, orjson.dumps(body)
    return exc.status_code, orjson.dumps({"error": exc.to_dict()})


def terminal_frame(path: str, exc: GatewayError, sequence_number: int) -> bytes:
    """The last event of a stream on `path` cut from outside its generation (a drain timeout)."""
    if path == "/v1/messages":
        return anthropic_error_frame(exc)
    if path == "/v1/responses":
        return responses_error_event(exc, sequence_number)
    return openai_error_frame(exc)


__all__ = [
    "anthropic_error",
    "anthropic_error_frame",
    "error_body",
    "openai_error",
    "openai_error_frame",
    "responses_error_event",
    "terminal_frame",
]
