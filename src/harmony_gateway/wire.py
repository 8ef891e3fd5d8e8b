"""What an error looks like on each wire, as values (REFERENCE §8): a `Wire` names how a `GatewayError`
(or a gateway bug) is answered before the first byte of a response (the HTTP status and JSON body) and
how a stream ends after it (its terminal frame). Three wires exist: `OPENAI` (Chat Completions,
completions, `/generate`: `{"error": {message, type, param, code}}` with the error's own status; a
stream ends with `data: {"error": ...}` and `[DONE]`), `RESPONSES` (the OpenAI body; a stream ends with
an `error` event numbered after the stream's last event; on a WebSocket, a turn that fails before its
first event gets the socket's own `error` event, `responses_socket_error`) and `ANTHROPIC` (the
Messages API's statuses, 529 when overloaded, and `{"type": "error", "error": {type, message}}`; a
stream ends with an `error` event).

A route sets its wire on the `RequestContext`, from which the stream driver, the error handlers and
traffic control frame errors; before a route ran, they read the wire of each route from
`traffic.routes.RouteMap`, which the app builds from the surface table. Stages raise typed errors only.
This module is a leaf: it imports only the errors and the SSE framing, so the pipeline, traffic control
and the API all read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from .errors import GatewayError, InternalError, PayloadTooLarge, RequestTimeout
from .sse import DONE, data_frame, event_frame


@dataclass(frozen=True, slots=True)
class Wire:
    """One wire's error contract.

    `error_response(exc)` is the `(status, body)` of `exc` before any byte was sent; `stream_error(exc,
    next_sequence)` is the last frame of a stream that fails, or is cut, after its first byte, where
    `next_sequence` is the sequence number the stream's next event would take (wires that do not number
    their events ignore it)."""

    name: str
    error_response: Callable[[BaseException], tuple[int, dict[str, Any]]]
    stream_error: Callable[[BaseException, int], bytes]
    #: The response headers that carry the request id (Anthropic's SDK reads `request-id`).
    request_id_headers: tuple[str, ...] = ("x-request-id",)

    def id_headers(self, request_id: str) -> dict[str, str]:
        return dict.fromkeys(self.request_id_headers, request_id)

    def error_body(self, exc: BaseException) -> tuple[int, bytes]:
        """`error_response(exc)` with its body encoded."""
        status, body = self.error_response(exc)
        return status, orjson.dumps(body)


# -- OpenAI: Chat Completions, completions, /generate --------------------------------------------------------
def _openai_error(exc: BaseException) -> dict[str, Any]:
    """The OpenAI error object of `exc` in a stream (a gateway bug is an opaque internal error)."""
    if isinstance(exc, GatewayError):
        return exc.to_dict()
    return {
        "message": "internal error while streaming",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def _openai_response(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, GatewayError):
        return exc.status_code, {"error": exc.to_dict()}
    error = {"message": "internal error", "type": "server_error", "param": None, "code": "internal_error"}
    return 500, {"error": error}


def _openai_stream_error(exc: BaseException, next_sequence: int) -> bytes:
    return data_frame({"error": _openai_error(exc)}) + DONE


OPENAI = Wire("openai", _openai_response, _openai_stream_error)


# -- Responses -----------------------------------------------------------------------------------------------
def responses_error_event(
    sequence_number: int,
    code: str,
    message: str,
    param: str | None = None,
    *,
    error_type: str = "server_error",
) -> bytes:
    """A Responses stream's `error` event: the end of a stream that cannot reach its own terminal event.
    OpenAI's schema puts `code`, `message` and `param` on the event, Open Responses' nests them (with the
    error's `type`) in `error`: the event carries both, so a client of either finds them."""
    event = {
        "type": "error",
        "code": code,
        "message": message,
        "param": param,
        "error": {"type": error_type, "code": code, "message": message, "param": param},
        "sequence_number": sequence_number,
    }
    return event_frame("error", event)


def _responses_stream_error(exc: BaseException, next_sequence: int) -> bytes:
    error = _openai_error(exc)
    return responses_error_event(
        next_sequence,
        str(error["code"]),
        str(error["message"]),
        error["param"],
        error_type=str(error["type"]),
    )


RESPONSES = Wire("responses", _openai_response, _responses_stream_error)


def responses_socket_error(
    exc: BaseException, headers: dict[str, str] | None = None, *, sequence_number: int | None = None
) -> dict[str, Any]:
    """The `error` event of a Responses WebSocket (OpenAI's `ResponseWsError`) for what `POST
    /v1/responses` would answer with an HTTP error: the status it would have, the same error object,
    and the headers the answer would carry (`x-request-id`, `retry-after`) in it. A socket's error
    event leaves the socket open. `sequence_number` numbers one that ends a response's events."""
    status, body = _openai_response(exc)
    error = dict(body["error"])
    if headers:
        error["headers"] = headers
    event: dict[str, Any] = {"type": "error", "status": status, "error": error}
    if sequence_number is not None:
        event["sequence_number"] = sequence_number
    return event


# -- Anthropic Messages --------------------------------------------------------------------------------------
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


def _anthropic_response(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, GatewayError):
        status, error_type = _ANTHROPIC_ERRORS.get(exc.status_code, (exc.status_code, "api_error"))
        if status < 400:
            status = 500
        where = f" (at {exc.param})"
        message = exc.message if exc.param is None or exc.message.endswith(where) else exc.message + where
    else:
        status, error_type, message = 500, "api_error", "internal error"
    return status, {"type": "error", "error": {"type": error_type, "message": message}}


def _anthropic_stream_error(exc: BaseException, next_sequence: int) -> bytes:
    return event_frame("error", _anthropic_response(exc)[1])


ANTHROPIC = Wire(
    "anthropic",
    _anthropic_response,
    _anthropic_stream_error,
    request_id_headers=("request-id", "x-request-id"),
)


# -- the headers of an error response -------------------------------------------------------------------------
#: Statuses whose error says when to come back even without its own `retry_after`.
_COME_BACK = frozenset({429, 503})


def error_headers(wire: Wire, exc: GatewayError, request_id: str) -> dict[str, str]:
    """The headers of `exc`'s error response on `wire`, on every path that answers one (the routes' error
    handlers, traffic control's refusals, the request guard): the request id as the wire names it, when
    to retry, whether to, and `connection: close` when the rest of the body may still be on the wire."""
    headers = wire.id_headers(request_id) if request_id else {}
    if exc.retry_after is not None:
        headers["retry-after"] = str(max(1, round(exc.retry_after)))
        headers["retry-after-ms"] = str(int(exc.retry_after * 1000))
    elif exc.status_code in _COME_BACK:
        headers["retry-after"] = "1"
    # A client error does not heal on retry unless it says when to come back (a limit that refills, a
    # response still running), nor does a gateway bug.
    if (
        (exc.status_code < 500 and exc.status_code != 429 and exc.retry_after is None)
        or exc.status_code == 501
        or isinstance(exc, InternalError)
    ):
        headers["x-should-retry"] = "false"
    if isinstance(exc, RequestTimeout | PayloadTooLarge):
        headers["connection"] = "close"
    return headers


class WiredRequest(Protocol):
    """What traffic control reads of a request its route took on (`pipeline.context.RequestContext`,
    left in the request's ASGI state): the wire it answers on, and how its stream ends when cut from
    outside (a drain timeout)."""

    wire: Wire

    def cut_frame(self, exc: BaseException) -> bytes: ...


__all__ = [
    "ANTHROPIC",
    "OPENAI",
    "RESPONSES",
    "Wire",
    "WiredRequest",
    "responses_error_event",
    "responses_socket_error",
    "error_headers",
]
