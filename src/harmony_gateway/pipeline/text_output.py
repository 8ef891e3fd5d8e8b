"""Stage 5, parse, for output that is text rather than Harmony tokens: `TextChoiceOutput`, the sibling of
`parse_output.ChoiceOutput` that the surfaces' plans use when `PreparedRequest.output_adapter` is set.

Two sources feed it: token ids from a gRPC engine serving a non-Harmony model (detokenized
incrementally, never splitting a UTF-8 character), and text from an HTTP upstream (`EngineChunk.text`,
plus anything the upstream parsed itself in `upstream_delta`). The text runs through the model's
`ParserChain` (reasoning parser, then tool-call parser; or the text-level Harmony parser) and comes
out as the same chat deltas `ChoiceOutput` produces, so every surface's framer serves both:

    (CONTENT, text) | (REASONING_TEXT, text) | (TOOL_OPEN, call_index, call_id, name) | (TOOL_ARGS, call_index, text)

Client `stop` strings are matched in the gateway on answer text only (never inside reasoning or tool
arguments, which the engine cannot tell apart). The matched string is cut, as OpenAI does, unless the
request sets `no_stop_trim: true` (SGLang's extension), which keeps it at the end of the answer. Either
way the answer ends at the match, `finish_reason` is `stop`, and the engine request is aborted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ..engines.base import EngineChunk, TokenLogprob, take_counts
from ..harmony.text_events import (
    ContentDelta,
    ReasoningDelta,
    Terminated,
    TextEvent,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ..harmony.text_parser import ParserStats
from .context import GatewayState, PreparedRequest
from .detokenize import IncrementalDetokenizer
from .parse_output import CONTENT, REASONING_TEXT, TOOL_ARGS, TOOL_OPEN, ChatChoice, StopScanner


@dataclass(slots=True, eq=False)
class TextToolCall:
    """A tool call of one choice; `text` is the argument text exactly as streamed."""

    call_id: str
    name: str
    text: str = ""


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


def logprob_entry(token_text: Callable[[int], str], logprob: TokenLogprob) -> dict[str, Any]:
    """One token's logprob in OpenAI's `Logprob` shape (token, logprob, bytes, top_logprobs), as Chat
    Completions and Responses report it; `token_text` gives a token id's text."""
    text = token_text(logprob.token_id)
    return {
        "token": text,
        "logprob": logprob.logprob,
        "bytes": list(text.encode()),
        "top_logprobs": [
            {"token": (t := token_text(tid)), "logprob": value, "bytes": list(t.encode())}
            for tid, value in logprob.top
        ],
    }


class TextChoiceOutput(ChatChoice):
    """The output of one choice of a text-output model, for Chat Completions (module docstring)."""

    def __init__(self, state: GatewayState, prepared: PreparedRequest, index: int) -> None:
        super().__init__(index)
        spec = prepared.output_adapter
        if spec is None:
            raise TypeError("TextChoiceOutput needs a request whose output is text (`output_adapter`)")
        self.chain = spec.new_chain()
        self.stats: ParserStats | None = self.chain.stats if self.chain is not None else None
        self._tokenizer = spec.tokenizer
        self._detok = IncrementalDetokenizer(spec.tokenizer.tokenizer) if spec.tokenizer is not None else None
        self._stop = (
            StopScanner(prepared.stop_strings, keep=spec.no_stop_trim) if prepared.stop_strings else None
        )
        self.want_logprobs = prepared.return_logprob
        #: With stop strings: the answer text as generated, before any cut (names the matched stop).
        self.answer_seen: list[str] = []
        self.tool_calls: list[TextToolCall] = []
        self.logprobs: list[dict[str, Any]] = []
        self._pending_logprobs: list[dict[str, Any]] = []
        self._open_calls: dict[Any, TextToolCall] = {}
        self._call_index: dict[Any, int] = {}
        self._upstream_calls: list[TextToolCall] = []
        # Token accounting (chat_usage reads `parser.output_tokens` / `parser.reasoning_tokens`).
        self.output_tokens = 0
        self._upstream_reasoning_tokens: int | None = None
        # The per-chunk hot path for text upstreams: the chain's first parser directly when nothing
        # follows it (the text-level Harmony parser), else the chain; None when the text is the answer.
        chain = self.chain
        self._parse = (
            None
            if chain is None
            else (chain.first.feed if chain.then is None and chain.first else chain.feed)
        )
        self._plain = self._stop is None

    @property
    def parser(self) -> TextChoiceOutput:
        """The token counters `respond.chat_usage` reads from a choice's parser."""
        return self

    @property
    def reasoning_tokens(self) -> int:
        if self._tokenizer is not None:
            # The reasoning text re-tokenized: exact up to merges across the reasoning boundary, and
            # the same whether the engine streamed token by token or sent everything at once.
            if not self.reasoning_parts:
                return 0
            return min(len(self._tokenizer.encode("".join(self.reasoning_parts))), self.output_tokens)
        if self._upstream_reasoning_tokens is not None:
            return self._upstream_reasoning_tokens
        # Text upstreams that do not report it: the reasoning share of the characters, in tokens.
        reasoning = sum(map(len, self.reasoning_parts))
        chars = reasoning + sum(map(len, self.content_parts)) + sum(len(c.text) for c in self.tool_calls)
        total = self.completion_tokens or self.output_tokens
        return round(total * reasoning / chars) if chars else 0

    # -- engine chunks → chat deltas ------------------------------------------------------------
    def feed(self, chunk: EngineChunk) -> list[tuple[Any, ...]]:
        text = chunk.text
        if text and not chunk.finished and chunk.upstream_delta is None and not self.finished:
            # Text upstreams, a chunk in the middle of the stream: the cheap path.
            parse = self._parse
            if parse is None:
                if self._plain:
                    self.content_parts.append(text)
                    return [(CONTENT, text)]
                events: list[TextEvent] = [ContentDelta(text)]
            else:
                events = parse(text)
                if len(events) == 1:
                    event = events[0]
                    kind = type(event)
                    if kind is ReasoningDelta:
                        piece = event.text  # type: ignore[union-attr]
                        self.reasoning_parts.append(piece)
                        return [(REASONING_TEXT, piece)] if self.include_reasoning else []
                    if kind is ContentDelta and self._plain:
                        piece = event.text  # type: ignore[union-attr]
                        self.content_parts.append(piece)
                        return [(CONTENT, piece)]
                elif not events:
                    return []  # text held back (a possible marker), nothing to say yet
            fast: list[tuple[Any, ...]] = []
            self._translate(events, fast)
            return fast
        if self.finished:
            return []
        deltas: list[tuple[Any, ...]] = []
        take_counts(self, chunk)
        upstream = chunk.upstream_delta
        if upstream is not None:
            self._upstream(upstream, deltas)
        if chunk.text is not None:
            text = chunk.text
        elif self._detok is not None and chunk.token_ids:
            text = self._detok.push(chunk.token_ids)
        else:
            text = ""
        if text:
            self._translate(self.chain.feed(text) if self.chain is not None else [ContentDelta(text)], deltas)
        if chunk.token_ids:
            self.output_tokens += len(chunk.token_ids)
            if self.want_logprobs and chunk.logprobs:
                self._add_logprobs(chunk.logprobs)
        if chunk.finished:
            self.engine_finish = chunk.finish_reason
            self.matched_stop = chunk.matched_stop_token or chunk.matched_stop_str
            deltas.extend(self._finish())
        return deltas

    def close(self) -> list[tuple[Any, ...]]:
        """Finish when the output ends without a finished chunk (a stop string was hit, or the engine
        stream ended early)."""
        if self.finished:
            return []
        return self._finish()

    def _finish(self) -> list[tuple[Any, ...]]:
        self.finished = True
        deltas: list[tuple[Any, ...]] = []
        if self.stop_hit:
            return deltas
        tail = self._detok.flush() if self._detok is not None else ""
        events: list[TextEvent] = []
        if self.chain is not None:
            if tail:
                events.extend(self.chain.feed(tail))
            events.extend(self.chain.finish())
        elif tail:
            events.append(ContentDelta(tail))
        self._translate(events, deltas)
        if self._stop is not None and not self.stop_hit:
            rest = self._stop.flush()
            if rest:
                self._content(rest, deltas)
        self.tool_calls.extend(self._upstream_calls)
        self._upstream_calls = []
        return deltas

    def _content(self, text: str, deltas: list[tuple[Any, ...]]) -> None:
        self.content_parts.append(text)
        deltas.append((CONTENT, text))

    def _reasoning(self, text: str, deltas: list[tuple[Any, ...]]) -> None:
        self.reasoning_parts.append(text)
        if self.include_reasoning:
            deltas.append((REASONING_TEXT, text))

    def _translate(self, events: list[TextEvent], deltas: list[tuple[Any, ...]]) -> None:
        for event in events:
            if self.stop_hit:
                return  # nothing after the answer's stop string
            kind = type(event)
            if kind is ContentDelta:
                text = event.text  # type: ignore[union-attr]
                if self._stop is not None:
                    self.answer_seen.append(text)
                    text, hit = self._stop.push(text)
                    if hit:
                        self.stop_hit = True
                        self.engine_finish = "stop"
                if text:
                    self._content(text, deltas)
            elif kind is ReasoningDelta:
                self._reasoning(event.text, deltas)  # type: ignore[union-attr]
            elif kind is ToolCallStart:
                self._open_call(("p", event.index), event.id or new_call_id(), event.name, deltas)  # type: ignore[union-attr]
            elif kind is ToolCallArgumentsDelta:
                call = self._open_calls.get(("p", event.index))  # type: ignore[union-attr]
                if call is not None:
                    call.text += event.text  # type: ignore[union-attr]
                    deltas.append((TOOL_ARGS, self._call_index[("p", event.index)], event.text))  # type: ignore[union-attr]
            elif kind is ToolCallEnd:
                call = self._open_calls.pop(("p", event.index), None)  # type: ignore[union-attr]
                if call is not None:
                    self.tool_calls.append(call)
            elif kind is Terminated:
                pass

    def _open_call(self, key: Any, call_id: str, name: str, deltas: list[tuple[Any, ...]]) -> TextToolCall:
        call = TextToolCall(call_id, name)
        self._open_calls[key] = call
        index = self._call_index[key] = len(self._call_index)
        deltas.append((TOOL_OPEN, index, call_id, name))
        return call

    def _upstream(self, upstream: dict[str, Any], deltas: list[tuple[Any, ...]]) -> None:
        """Reasoning and tool calls the upstream parsed itself pass through unchanged."""
        reasoning = upstream.get("reasoning")
        if reasoning and not self.stop_hit:
            self._reasoning(reasoning, deltas)
        for call in upstream.get("tool_calls") or ():
            key = ("u", call.get("index", 0))
            function = call.get("function") or {}
            current = self._open_calls.get(key)
            if current is None:
                current = self._open_call(
                    key, call.get("id") or new_call_id(), function.get("name") or "", deltas
                )
                self._upstream_calls.append(current)
            args = function.get("arguments")
            if args:
                if not isinstance(args, str):
                    args = orjson.dumps(args).decode()
                current.text += args
                deltas.append((TOOL_ARGS, self._call_index[key], args))
        if "reasoning_tokens" in upstream:
            self._upstream_reasoning_tokens = upstream["reasoning_tokens"]
        entries = upstream.get("logprobs")
        if entries and self.want_logprobs:
            self.logprobs.extend(entries)
            self._pending_logprobs.extend(entries)

    # -- logprobs --------------------------------------------------------------------------------
    def _add_logprobs(self, logprobs: list[TokenLogprob]) -> None:
        if self._tokenizer is None:
            return  # a text-mode upstream: logprobs are refused before the request is sent
        token_text = self._tokenizer.token_text
        for lp in logprobs:
            entry = logprob_entry(token_text, lp)
            self.logprobs.append(entry)
            self._pending_logprobs.append(entry)

    def take_logprobs(self) -> list[dict[str, Any]]:
        """Entries not yet sent on the stream (the stream writer attaches them to the next chunk)."""
        pending, self._pending_logprobs = self._pending_logprobs, []
        return pending


def text_parser_stats(choices: list[Any]) -> list[ParserStats]:
    """The parser counters of text choices, for the end-of-request metrics."""
    return [c.stats for c in choices if isinstance(c, TextChoiceOutput) and c.stats is not None]


__all__ = [
    "TextChoiceOutput",
    "TextToolCall",
    "logprob_entry",
    "new_call_id",
    "text_parser_stats",
]
