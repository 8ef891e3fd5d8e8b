"""What an error looks like on each wire, as values (REFERENCE §8): a `Wire` names how a `GatewayError`
(or a gateway bug) is answered before the first byte of a response (the HTTP status and JSON body) and
how a stream ends after it (its terminal frame). Three wires exist: `OPENAI` (Chat Completions,
completions, `/generate`: `{"error": {message, type, param, code}}` with the error's own status; a
stream ends with `data: {"error": ...}` and `[DONE]`), `RESPONSES` (the OpenAI body; a stream ends with
an `error` event numbered after the stream's last event) and `ANTHROPIC` (the Messages API's statuses,
529 when overloaded, and `{"type": "error", "error": {type, message}}`; a stream ends with an `error`
event).

A route sets its wire on the `RequestContext`, from which the stream driver and traffic control frame
errors; before a route ran, traffic control reads `ROUTE_WIRES`, the one table of which route answers
on which wire. Stages raise typed errors only. This module is a leaf: it imports only the errors and the
SSE framing, so the pipeline, traffic control and the API all read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from .errors import GatewayError
from .pipeline.sse import DONE, data_frame, event_frame


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
def responses_error_event(sequence_number: int, code: str, message: str, param: str | None = None) -> bytes:
    """A Responses stream's `error` event: the end of a stream that cannot reach its own terminal event."""
    event = {
        "type": "error",
        "code": code,
        "message": message,
        "param": param,
        "sequence_number": sequence_number,
    }
    return event_frame("error", event)


def _responses_stream_error(exc: BaseException, next_sequence: int) -> bytes:
    error = _openai_error(exc)
    return responses_error_event(next_sequence, str(error["code"]), str(error["message"]), error["param"])


RESPONSES = Wire("responses", _openai_response, _responses_stream_error)


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


ANTHROPIC = Wire("anthropic", _anthropic_response, _anthropic_stream_error)


# -- which route answers on which wire -----------------------------------------------------------------------
#: The wire of each generating route and of the Messages API's token counting (method, path as
#: registered): what traffic control answers in before the route ran (a rate limit, admission, a body
#: too large, a drain). Every other route answers on the OpenAI wire.
ROUTE_WIRES: dict[tuple[str, str], Wire] = {
    ("POST", "/v1/chat/completions"): OPENAI,
    ("POST", "/v1/completions"): OPENAI,
    ("POST", "/generate"): OPENAI,
    ("POST", "/v1/responses"): RESPONSES,
    ("POST", "/v1/messages"): ANTHROPIC,
    ("POST", "/v1/messages/count_tokens"): ANTHROPIC,
}


def route_wire(method: str, path: str) -> Wire:
    """The wire `method path` answers on before its route ran (`ROUTE_WIRES`; OpenAI's otherwise)."""
    return ROUTE_WIRES.get((method, path), OPENAI)


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
    "ROUTE_WIRES",
    "Wire",
    "WiredRequest",
    "responses_error_event",
    "route_wire",
]
