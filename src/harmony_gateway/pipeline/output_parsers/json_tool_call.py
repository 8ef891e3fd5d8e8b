"""Tool-call parser for the common `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form
(Hermes, Qwen2.5/Qwen3 chat templates), over answer text.

Text outside the tags is content, streamed as it arrives except for a suffix that could start
`<tool_call>`. A call is emitted once its closing tag arrives (`ToolCallStart`, the arguments as one
`ToolCallArgumentsDelta`, `ToolCallEnd`): the name must be known before the opener is sent, and the
arguments are re-serialised compactly only when the model gave an object (`"arguments": "<json>"`
strings pass through unchanged). A block that is not JSON of that shape is passed on as content,
tags included, and counted as a parse error. Whitespace between calls is dropped. An unclosed block
at the end is parsed as if closed when it is complete JSON, else passed on as content.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ...harmony.text_events import (
    ContentDelta,
    Terminated,
    TextEvent,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ...harmony.text_parser import ParserStats

log = logging.getLogger(__name__)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0


def parse_call(block: str) -> tuple[str, str] | None:
    """(name, arguments text) of one call body, or None when it is not a call."""
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args: Any = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):
        return name.strip(), args
    return name.strip(), json.dumps(args, ensure_ascii=False, separators=(", ", ": "))


class JsonToolCallParser:
    """Incremental; see the module docstring. Implements `TextOutputParser`."""

    def __init__(self, *, stats: ParserStats | None = None) -> None:
        self.stats = stats if stats is not None else ParserStats()
        self._buf = ""
        self._in_call = False
        self._calls = 0
        self._finished = False
        self._out: list[TextEvent] = []

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._calls and not text.strip():
            return  # newlines between calls
        self.stats.content_chars += len(text)
        out = self._out
        if out and type(out[-1]) is ContentDelta:
            out[-1] = ContentDelta(out[-1].text + text)
        else:
            out.append(ContentDelta(text))

    def _call(self, block: str) -> None:
        parsed = parse_call(block.strip())
        if parsed is None:
            self.stats.parse_errors += 1
            log.debug("tool-call block is not a JSON call; passing it on as content")
            self._content(OPEN + block + CLOSE)
            return
        name, args = parsed
        index = self._calls
        self._calls += 1
        self.stats.channel_messages["tool_call"] += 1
        self._out.append(ToolCallStart(index, name))
        if args:
            self._out.append(ToolCallArgumentsDelta(index, args))
        self._out.append(ToolCallEnd(index))

    def feed(self, chunk: str) -> list[TextEvent]:
        if self._finished:
            self.stats.trailing_ignored_chars += len(chunk)
            return []
        self._out = []
        buf = self._buf + chunk
        while buf:
            if self._in_call:
                end = buf.find(CLOSE)
                if end < 0:
                    break
                self._call(buf[:end])
                buf = buf[end + len(CLOSE) :]
                self._in_call = False
                continue
            start = buf.find(OPEN)
            if start >= 0:
                self._content(buf[:start])
                buf = buf[start + len(OPEN) :]
                self._in_call = True
                continue
            hold = _partial_suffix(buf, OPEN)
            self._content(buf[: len(buf) - hold])
            buf = buf[len(buf) - hold :]
            break
        self._buf = buf
        return self._out

    def finish(self) -> list[TextEvent]:
        if self._finished:
            return []
        self._finished = True
        self._out = []
        buf, self._buf = self._buf, ""
        if self._in_call:
            if parse_call(buf.strip()) is not None:
                self._call(buf)
            else:
                self.stats.parse_errors += 1
                self._content(OPEN + buf)
        else:
            self._content(buf)
        self._out.append(Terminated("eos"))
        return self._out


__all__ = ["CLOSE", "OPEN", "JsonToolCallParser", "parse_call"]
