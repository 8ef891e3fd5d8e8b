"""Stage 5, parse: engine chunks of one choice → parser events → chat-level deltas.

`ChoiceOutput` owns one `HarmonyOutputParser` per choice. It feeds new token ids in order, closes the
output when the engine finishes (feeding a stripped stop token, or `process_eos()`), applies client
stop strings to answer text only, and counts tokens. Chat deltas are tuples so the per-token path
allocates little:

    (CONTENT, text) | (REASONING_TEXT, text) | (TOOL_OPEN, call_index, call_id, name) | (TOOL_ARGS, call_index, text)

Streamed and non-streamed responses are both built from these deltas, so their texts are identical.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..engines.base import EngineChunk, take_counts
from ..harmony import token_parser as tp
from ..harmony.encoding import ASSISTANT_STOP_IDS
from .context import GatewayState, PreparedRequest

CONTENT = 0
REASONING_TEXT = 1
TOOL_OPEN = 2
TOOL_ARGS = 3


def parse_chunk(parser: tp.HarmonyOutputParser, chunk: EngineChunk) -> list[tp.Event]:
    """Feed one engine chunk; on the choice's last chunk also close the output: feed a stop token the
    engine stripped (so the last message ends as generated), then close anything unterminated. A whole
    output in one chunk (non-stream) takes the parser's pure-Python path when it has the canonical shape."""
    if chunk.finished and chunk.token_ids and parser.fresh:
        events = parser.parse_complete(chunk.token_ids, chunk.matched_stop_token)
        if events is not None:
            return events
    return feed_chunk(parser, chunk)


def feed_chunk(parser: tp.HarmonyOutputParser, chunk: EngineChunk) -> list[tp.Event]:
    """`parse_chunk` token by token through openai-harmony's StreamableParser."""
    events = parser.feed(chunk.token_ids) if chunk.token_ids else []
    if chunk.finished:
        stop_token = chunk.matched_stop_token
        if stop_token in ASSISTANT_STOP_IDS and not parser.halted and parser.in_message:
            events += parser.feed([stop_token])
        events += parser.finish()
    return events


def chat_finish_reason(stop_hit: bool, engine_finish: str | None, tool_calls: Sequence[object]) -> str:
    """`stop` after a client stop string; then `length` (a call cut by length must not be executed); then
    `tool_calls`; else `stop`."""
    if stop_hit:
        return "stop"
    if engine_finish == "length":
        return "length"
    if tool_calls:
        return "tool_calls"
    return "stop"


class StopScanner:
    """Finds client stop strings in answer text, holding back a tail that may start a stop string. With
    `keep=True` (`no_stop_trim`) the matched string stays in the emitted text."""

    __slots__ = ("_buffer", "_hold", "_keep", "_stops")

    def __init__(self, stops: tuple[str, ...], *, keep: bool = False) -> None:
        self._stops = stops
        self._hold = max(len(s) for s in stops) - 1
        self._keep = keep
        self._buffer = ""

    def push(self, text: str) -> tuple[str, bool]:
        buffer = self._buffer + text
        cut = -1
        length = 0
        for stop in self._stops:
            at = buffer.find(stop)
            if at >= 0 and (cut < 0 or at < cut):
                cut, length = at, len(stop)
        if cut >= 0:
            self._buffer = ""
            return buffer[: cut + length] if self._keep else buffer[:cut], True
        if self._hold and len(buffer) > self._hold:
            self._buffer = buffer[-self._hold :]
            return buffer[: -self._hold], False
        if self._hold:
            self._buffer = buffer
            return "", False
        self._buffer = ""
        return buffer, False

    def flush(self) -> str:
        text, self._buffer = self._buffer, ""
        return text


class ChatChoice:
    """What the output of one chat choice keeps, whether parsed from Harmony tokens (`ChoiceOutput`) or
    from text (`text_output.TextChoiceOutput`): how it ended, the engine's counts, and the answer,
    reasoning and tool calls accumulated for non-stream bodies and usage."""

    __slots__ = (
        "cached_tokens",
        "completion_tokens",
        "content_parts",
        "engine_finish",
        "finished",
        "include_reasoning",
        "index",
        "matched_stop",
        "prompt_tokens",
        "reasoning_parts",
        "stop_hit",
    )

    #: The choice's finished tool calls, in order.
    tool_calls: Sequence[object]

    def __init__(self, index: int) -> None:
        self.index = index
        self.stop_hit = False
        self.finished = False
        self.engine_finish: str | None = None
        self.matched_stop: int | str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.include_reasoning = True
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []

    @property
    def finish_reason(self) -> str:
        return chat_finish_reason(self.stop_hit, self.engine_finish, self.tool_calls)


class ChoiceOutput(ChatChoice):
    """The output of one choice, for Chat Completions."""

    __slots__ = (
        "_answer_started",
        "_reasoning_separator_due",
        "_reasoning_started",
        "_separator_due",
        "_stop",
        "parser",
        "tool_calls",
    )

    def __init__(self, state: GatewayState, prepared: PreparedRequest, index: int) -> None:
        super().__init__(index)
        self.parser = tp.HarmonyOutputParser(
            state.encoding, prepared.function_names, prepared.tool_namespaces
        )
        self._stop = StopScanner(prepared.stop_strings) if prepared.stop_strings else None
        self._answer_started = False
        self._reasoning_started = False
        self._separator_due = False
        self._reasoning_separator_due = False
        self.tool_calls: list[tp.ParsedMessage] = []

    # -- engine chunks → chat deltas ------------------------------------------------------------
    def feed(self, chunk: EngineChunk) -> list[tuple[Any, ...]]:
        if self.finished:
            return []
        if chunk.finished:
            events = parse_chunk(self.parser, chunk)
        else:  # the per-token case, without parse_chunk's closing checks
            events = self.parser.feed(chunk.token_ids) if chunk.token_ids else []
        take_counts(self, chunk)
        if chunk.finished:
            self.engine_finish = chunk.finish_reason
            self.matched_stop = chunk.matched_stop_token or chunk.matched_stop_str
            self.finished = True  # parse_chunk has closed the output
        return self._translate(events) if events else []

    def close(self) -> list[tuple[Any, ...]]:
        """Finish parsing when the output ends without a finished chunk (a stop string was hit)."""
        if self.finished:
            return []
        self.finished = True
        return self._translate(self.parser.finish())

    def _translate(self, events: list[tp.Event]) -> list[tuple[Any, ...]]:
        deltas: list[tuple[Any, ...]] = []
        for etype, msg, text in events:
            kind = msg.kind
            if kind == tp.ANSWER or kind == tp.PREAMBLE:
                if self.stop_hit:
                    continue
                if etype == tp.DELTA:
                    if self._stop is not None:
                        text, hit = self._stop.push(text)  # type: ignore[arg-type]
                        if hit:
                            self.stop_hit = True
                            self.engine_finish = "stop"
                    if text:
                        if self._separator_due:
                            text = "\n" + text
                            self._separator_due = False
                        self._answer_started = True
                        self.content_parts.append(text)
                        deltas.append((CONTENT, text))
                elif etype == tp.START:
                    self._separator_due = self._answer_started
                elif self._stop is not None:  # DONE: release the held-back tail
                    tail = self._stop.flush()
                    if tail:
                        self.content_parts.append(tail)
                        deltas.append((CONTENT, tail))
            elif kind == tp.REASONING:
                if etype == tp.DELTA:
                    if self._reasoning_separator_due:
                        text = "\n" + text  # type: ignore[operator]
                        self._reasoning_separator_due = False
                    self._reasoning_started = True
                    self.reasoning_parts.append(text)  # type: ignore[arg-type]
                    if self.include_reasoning:
                        deltas.append((REASONING_TEXT, text))
                elif etype == tp.START:
                    self._reasoning_separator_due = self._reasoning_started
            elif kind == tp.FUNCTION_CALL:
                if etype == tp.START:
                    deltas.append((TOOL_OPEN, msg.call_index, msg.call_id, msg.name))
                elif etype == tp.DELTA:
                    deltas.append((TOOL_ARGS, msg.call_index, text))
                elif msg.terminated:
                    self.tool_calls.append(msg)
        return deltas
