"""Responses output: parser events → output items, and → the OpenAI Responses stream events (REFERENCE §3.6,
§4). Item ids are minted once, when an item starts, so the terminal event carries exactly the ids that
were streamed; `content_index` restarts at 0 for every item; every part and item opened is closed before
the terminal event, so the pairing/stack invariant holds on every path, failures included."""

from __future__ import annotations

import time
from typing import Any

import orjson

from ..harmony import token_parser as tp
from .responses_input import new_id

_dumps = orjson.dumps


def frame(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _dumps(event) + b"\n\n"


class ResponseBuilder:
    """Accumulates one response's output items and, when streaming, its SSE frames."""

    def __init__(self, envelope: dict[str, Any], *, stream: bool, sequence_start: int = 0) -> None:
        self.envelope = envelope  # the Response object without output/status/usage
        self.output: list[dict[str, Any]] = []
        self.stream = stream
        self.sequence = sequence_start
        self._open: dict[int, tuple[dict[str, Any], int]] = {}  # id(msg) -> (item, output_index)
        self.frames: list[bytes] = []
        self.usage: dict[str, Any] | None = None

    # -- framing ----------------------------------------------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        if self.stream:
            event["sequence_number"] = self.sequence
            self.sequence += 1
            self.frames.append(frame(event))

    def take(self) -> bytes:
        out = b"".join(self.frames)
        self.frames.clear()
        return out

    def snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        body = dict(self.envelope)
        body["status"] = status
        body["output"] = list(self.output)
        body["usage"] = self.usage
        body.update(extra)
        return body

    def start(self, status: str = "in_progress") -> None:
        self.emit({"type": "response.created", "response": self.snapshot(status)})
        self.emit({"type": "response.in_progress", "response": self.snapshot(status)})

    # -- items ------------------------------------------------------------------------------------
    def add_item(self, item: dict[str, Any]) -> int:
        """Append a finished item (e.g. an MCP list) with its added/done events; returns its index."""
        index = len(self.output)
        self.output.append(item)
        self.emit({"type": "response.output_item.added", "output_index": index, "item": item})
        self.emit({"type": "response.output_item.done", "output_index": index, "item": item})
        return index

    def open_item(self, item: dict[str, Any]) -> int:
        index = len(self.output)
        self.output.append(item)
        self.emit(
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": dict(item, content=[]) if "content" in item else dict(item),
            }
        )
        return index

    def on_events(self, events: list[tp.Event]) -> None:
        for etype, msg, text in events:
            kind = msg.kind
            if kind == tp.DROPPED or kind == tp.TOOL_CALL:
                continue  # tool calls executed by the gateway are reported by the tool loop
            key = id(msg)
            if etype == tp.START:
                self._start(key, msg)
            elif etype == tp.DELTA:
                item, index = self._open[key]
                if kind == tp.FUNCTION_CALL:
                    item["arguments"] += text
                    self.emit(
                        {
                            "type": "response.function_call_arguments.delta",
                            "item_id": item["id"],
                            "output_index": index,
                            "delta": text,
                        }
                    )
                elif kind == tp.REASONING:
                    item["content"][0]["text"] += text
                    self.emit(
                        {
                            "type": "response.reasoning_text.delta",
                            "item_id": item["id"],
                            "output_index": index,
                            "content_index": 0,
                            "delta": text,
                        }
                    )
                else:
                    item["content"][0]["text"] += text
                    self.emit(
                        {
                            "type": "response.output_text.delta",
                            "item_id": item["id"],
                            "output_index": index,
                            "content_index": 0,
                            "delta": text,
                            "logprobs": [],
                        }
                    )
            else:
                self._done(key, "completed" if msg.terminated else "incomplete")

    def _start(self, key: int, msg: tp.ParsedMessage) -> None:
        kind = msg.kind
        if kind == tp.FUNCTION_CALL:
            item = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": msg.call_id,
                "name": msg.name,
                "arguments": "",
                "status": "in_progress",
            }
            if msg.recipient and not msg.recipient.startswith("functions.") and "." in (msg.name or ""):
                # A tool of a client-declared namespace: OpenAI reports it as name + namespace.
                item["namespace"], item["name"] = msg.name.split(".", 1)  # type: ignore[union-attr]
            index = self.open_item(item)
        elif kind == tp.REASONING:
            item = {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            index = self.open_item(item)
            self.emit(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": {"type": "reasoning_text", "text": ""},
                }
            )
        else:
            item = {
                "type": "message",
                "id": new_id("msg"),
                "role": "assistant",
                "status": "in_progress",
                "phase": "commentary" if kind == tp.PREAMBLE else "final_answer",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
            }
            index = self.open_item(item)
            self.emit(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                }
            )
        msg.item_id = item["id"]
        self._open[key] = (item, index)

    def _done(self, key: int, status: str) -> None:
        entry = self._open.pop(key, None)
        if entry is None:
            return
        item, index = entry
        item["status"] = status
        if item["type"] == "function_call":
            self.emit(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self.emit(
                {
                    "type": "response.reasoning_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": part["text"],
                }
            )
            self.emit(
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": part,
                }
            )
        else:
            part = item["content"][0]
            self.emit(
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                }
            )
            self.emit(
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": part,
                }
            )
        self.emit({"type": "response.output_item.done", "output_index": index, "item": item})

    def close_open(self, status: str = "incomplete") -> None:
        """Close every open item (failure or cut): keeps the event stack balanced."""
        for key in list(self._open):
            self._done(key, status)

    # -- terminal ---------------------------------------------------------------------------------
    def finish(
        self, status: str, *, incomplete_reason: str | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        self.close_open("incomplete" if status != "completed" else "completed")
        extra: dict[str, Any] = {
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "error": error,
        }
        if status in ("completed", "incomplete", "failed", "cancelled"):
            extra["completed_at"] = int(time.time()) if status == "completed" else None
        body = self.snapshot(status, **extra)
        terminal = {
            "completed": "response.completed",
            "incomplete": "response.incomplete",
            "failed": "response.failed",
            "cancelled": "response.failed",
        }[status]
        self.emit({"type": terminal, "response": body})
        return body


def usage_of(
    input_tokens: int, output_tokens: int, reasoning_tokens: int, cached_tokens: int
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
