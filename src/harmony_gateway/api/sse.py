"""SSE framing and the only place, besides api/error_responses.py, that turns an exception into output:
once headers are sent, an error becomes a final event and the stream closes."""

from __future__ import annotations

import logging

import orjson

from ..errors import GatewayError

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def error_payload(exc: BaseException) -> dict[str, object]:
    if isinstance(exc, GatewayError):
        return exc.to_dict()
    return {
        "message": "internal error while streaming",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def chat_error_frame(exc: BaseException) -> bytes:
    """Chat Completions mid-stream error: `data: {"error": {...}}` then `[DONE]`."""
    if not isinstance(exc, GatewayError):
        log.exception("unexpected error while streaming", exc_info=exc)
    return b"data: " + orjson.dumps({"error": error_payload(exc)}) + b"\n\n" + DONE


def event_frame(event_type: str, data: dict[str, object]) -> bytes:
    return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
