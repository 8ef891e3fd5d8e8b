"""Server-sent event encoding, the respond stage's byte format for every streamed surface."""

from __future__ import annotations

import orjson

#: What every event's data starts with, and what ends an event: framers that keep a chunk's JSON as a
#: byte template around the per-token part (Chat Completions, completions) write these around it.
DATA_FIELD = b"data: "
EVENT_END = b"\n\n"

#: The end-of-stream marker of the OpenAI-style streams (Chat Completions, completions, `/generate`).
DONE = DATA_FIELD + b"[DONE]" + EVENT_END


def data_frame(data: object) -> bytes:
    """`data: {json}` (an event without a name)."""
    return DATA_FIELD + orjson.dumps(data) + EVENT_END


def event_frame(event_type: str, data: object) -> bytes:
    """`event: NAME` then `data: {json}` (Anthropic's and the Responses API's named events)."""
    return encoded_event_frame(event_type, orjson.dumps(data))


def encoded_event_frame(event_type: str, payload: bytes) -> bytes:
    """`event_frame` of data already encoded as JSON (`payload`)."""
    return b"event: " + event_type.encode() + b"\n" + DATA_FIELD + payload + EVENT_END


__all__ = ["DATA_FIELD", "DONE", "EVENT_END", "data_frame", "encoded_event_frame", "event_frame"]
