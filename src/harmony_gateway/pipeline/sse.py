"""Server-sent event encoding, the respond stage's byte format for every streamed surface."""

from __future__ import annotations

import orjson

#: The end-of-stream marker of the OpenAI-style streams (Chat Completions, completions, `/generate`).
DONE = b"data: [DONE]\n\n"


def data_frame(data: object) -> bytes:
    """`data: {json}` (an event without a name)."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def event_frame(event_type: str, data: object) -> bytes:
    """`event: NAME` then `data: {json}` (Anthropic's and the Responses API's named events)."""
    return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


__all__ = ["DONE", "data_frame", "event_frame"]
