"""Messages output: Harmony deltas become Anthropic content blocks (`thinking` with the gateway's signature,
`text`, `tool_use`), stop reasons and usage, as one JSON body or as Anthropic's stream events."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any

import orjson

from ...engines.base import EngineChunk
from ...harmony import token_parser as tp
from ...pipeline.context import PreparedRequest, RequestContext
from ...pipeline.drive import RequestFramer
from ...pipeline.parse_output import CONTENT, REASONING_TEXT, TOOL_ARGS, TOOL_OPEN, ChoiceOutput
from ...pipeline.reasoning_budget import budget_exceeded
from ...pipeline.text_output import TextChoiceOutput
from ...sse import encoded_event_frame

log = logging.getLogger(__name__)

_dumps = orjson.dumps


def thinking_signature(text: str) -> str:
    """An opaque signature the SDK accepts, for requests that never show thinking (count_tokens, other
    models); shown thinking is signed with the gateway key (`ReasoningVault.sign`)."""
    digest = hashlib.sha256(text.encode()).digest()[:24]
    return "hg1." + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def message_id(ctx: RequestContext) -> str:
    """The id of the request's message (`msg_` and the request id)."""
    return "msg_" + ctx.request_id


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or tp.new_call_id())[5:]


def parse_tool_input(arguments: str, name: str | None) -> tuple[dict[str, Any], bool]:
    """(input, valid): the arguments as a JSON object, or `{}` when they are not one."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value, True
    log.warning("tool call %s: arguments are not a JSON object; sent as input {}: %.200r", name, arguments)
    return {}, False


_THINKING, _TEXT, _TOOL = "thinking", "text", "tool_use"


class MessageBlocks:
    """Builds content blocks from one choice's chat-level deltas; with `stream`, also the SSE events.

    A block opens on the first delta of its kind and closes when another kind starts: a thinking block
    closes with a `signature_delta`, a tool_use block with its whole arguments as one `input_json_delta`.
    """

    def __init__(self, *, stream: bool, sign: Callable[[str], str] = thinking_signature) -> None:
        self.sign = sign
        self.blocks: list[dict[str, Any]] = []
        self._stream = stream
        self._kind: str | None = None
        self._parts: list[str] = []
        self._tool: dict[str, Any] | None = None

    def push(self, deltas: list[tuple[Any, ...]]) -> bytes:
        out: list[bytes] = []
        pending_kind: str | None = None
        pending: list[str] = []
        for delta in deltas:
            kind = delta[0]
            if kind == CONTENT or kind == REASONING_TEXT:
                block = _TEXT if kind == CONTENT else _THINKING
                text = delta[1]
                if self._kind != block:
                    self._flush(pending_kind, pending, out)
                    pending_kind, pending = None, []
                    self._close(out)
                    if text.startswith("\n"):
                        text = text[1:]  # the separator between two messages that now sit in two blocks
                    if not text:
                        continue
                    self._open(block, out)
                pending_kind = block
                pending.append(text)
                self._parts.append(text)
            elif kind == TOOL_OPEN:
                self._flush(pending_kind, pending, out)
                pending_kind, pending = None, []
                self._close(out)
                self._tool = {"id": tool_use_id(delta[2]), "name": delta[3]}
                self._open(_TOOL, out)
            elif kind == TOOL_ARGS and self._kind == _TOOL:
                self._parts.append(delta[2])
        self._flush(pending_kind, pending, out)
        return b"".join(out)

    def close(self) -> bytes:
        out: list[bytes] = []
        self._close(out)
        return b"".join(out)

    def _open(self, kind: str, out: list[bytes]) -> None:
        self._kind = kind
        self._parts = []
        if not self._stream:
            return
        if kind == _THINKING:
            start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
        elif kind == _TEXT:
            start = {"type": "text", "text": ""}
        else:
            start = {"type": "tool_use", **(self._tool or {}), "input": {}}
        payload = {"type": "content_block_start", "index": len(self.blocks), "content_block": start}
        out.append(encoded_event_frame("content_block_start", _dumps(payload)))

    def _flush(self, kind: str | None, pieces: list[str], out: list[bytes]) -> None:
        if not self._stream or kind is None or not pieces:
            return
        text = pieces[0] if len(pieces) == 1 else "".join(pieces)
        field = b'"thinking_delta","thinking":' if kind == _THINKING else b'"text_delta","text":'
        out.append(
            encoded_event_frame(
                "content_block_delta",
                b'{"type":"content_block_delta","index":%d,"delta":{"type":' % len(self.blocks)
                + field
                + _dumps(text)
                + b"}}",
            )
        )

    def _close(self, out: list[bytes]) -> None:
        kind = self._kind
        if kind is None:
            return
        index = len(self.blocks)
        text = "".join(self._parts)
        stream = self._stream
        if kind == _THINKING:
            signature = self.sign(text)
            self.blocks.append({"type": "thinking", "thinking": text, "signature": signature})
            if stream:
                delta = {"type": "signature_delta", "signature": signature}
                payload = {"type": "content_block_delta", "index": index, "delta": delta}
                out.append(encoded_event_frame("content_block_delta", _dumps(payload)))
        elif kind == _TEXT:
            self.blocks.append({"type": "text", "text": text})
        else:
            tool = self._tool or {}
            value, valid = parse_tool_input(text, tool.get("name"))
            self.blocks.append({"type": "tool_use", **tool, "input": value})
            if stream:
                partial = text if valid and text.strip() else _dumps(value).decode()
                delta = {"type": "input_json_delta", "partial_json": partial}
                payload = {"type": "content_block_delta", "index": index, "delta": delta}
                out.append(encoded_event_frame("content_block_delta", _dumps(payload)))
            self._tool = None
        if stream:
            out.append(
                encoded_event_frame("content_block_stop", b'{"type":"content_block_stop","index":%d}' % index)
            )
        self._kind = None
        self._parts = []


def matched_stop_sequence(choice: ChoiceOutput | TextChoiceOutput, stops: tuple[str, ...]) -> str | None:
    """The client stop sequence that ended the answer: the earliest in the answer text."""
    if isinstance(choice, TextChoiceOutput):
        text = "".join(choice.answer_seen)
    else:
        text = "".join(m.text for m in choice.parser.messages if m.kind in (tp.ANSWER, tp.PREAMBLE))
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best[1] if best else None


def stop_reason(choice: ChoiceOutput | TextChoiceOutput, stops: tuple[str, ...]) -> tuple[str, str | None]:
    if choice.stop_hit:
        return "stop_sequence", matched_stop_sequence(choice, stops)
    if choice.engine_finish == "length":
        return "max_tokens", None
    if choice.tool_calls:
        return "tool_use", None
    return "end_turn", None


def anthropic_usage(
    choice: ChoiceOutput | TextChoiceOutput, prepared: PreparedRequest, ctx: RequestContext
) -> dict[str, Any]:
    """`input_tokens` excludes cache reads, as Anthropic counts: total input = input + cache read + creation."""
    prompt = choice.prompt_tokens or len(prepared.input_ids)
    cached = min(choice.cached_tokens, prompt)
    details: dict[str, Any] = {"thinking_tokens": choice.parser.reasoning_tokens}
    if prepared.max_reasoning_tokens is not None:
        details["reasoning_budget_exceeded"] = budget_exceeded(ctx)
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": choice.completion_tokens or choice.parser.output_tokens,
        "output_tokens_details": details,
    }


# -- running a request -----------------------------------------------------------------------------
class MessagesFramer(RequestFramer):
    """Anthropic's event protocol: `message_start` (with the first chunk's prompt counts) and `ping`,
    content block events per engine chunk, then `message_delta` and `message_stop`; a failure is the
    `error` event. Not streaming, it only collects the blocks. A stop sequence ends it early."""

    __slots__ = ("_choice", "_head_due", "_prepared", "blocks", "unsettled")

    def __init__(
        self,
        prepared: PreparedRequest,
        ctx: RequestContext,
        choice: ChoiceOutput | TextChoiceOutput,
        *,
        stream: bool,
        sign: Callable[[str], str] = thinking_signature,
    ) -> None:
        super().__init__(ctx)
        self._prepared = prepared
        self._choice = choice
        self._head_due = stream
        self.blocks = MessageBlocks(stream=stream, sign=sign)
        self.unsettled = False

    def _head(self, first: EngineChunk | None) -> bytes:
        self._head_due = False
        prompt = (first.prompt_tokens if first is not None else 0) or len(self._prepared.input_ids)
        cached = min(first.cached_tokens if first is not None else 0, prompt)
        start = {
            "type": "message_start",
            "message": {
                "id": message_id(self._ctx),
                "type": "message",
                "role": "assistant",
                "model": self._prepared.group.name,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": prompt - cached,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": cached,
                    "output_tokens": 0,
                },
            },
        }
        return encoded_event_frame("message_start", _dumps(start)) + encoded_event_frame(
            "ping", b'{"type":"ping"}'
        )

    def feed(self, chunk: EngineChunk) -> bytes:
        head = self._head(chunk) if self._head_due else b""
        return head + self.blocks.push(self._choice.feed(chunk))

    def stopped(self) -> bool:
        return self._choice.stop_hit

    async def settle(self) -> None:
        """The turn's after-turn work (restorable analysis), before its closing events go out."""
        self.unsettled = False
        if self._prepared.after_turn is not None:
            await self._prepared.after_turn(self._choice)

    def tail(self) -> bytes:
        choice = self._choice
        tail = self._head(None) if self._head_due else b""
        tail += self.blocks.push(choice.close()) + self.blocks.close()
        self.unsettled = self._prepared.after_turn is not None
        reason, sequence = stop_reason(choice, self._prepared.stop_strings)
        usage = anthropic_usage(choice, self._prepared, self._ctx)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        return (
            tail
            + encoded_event_frame("message_delta", _dumps(delta))
            + encoded_event_frame("message_stop", b'{"type":"message_stop"}')
        )

    def completion_tokens(self) -> int:
        choice = self._choice
        return choice.completion_tokens or choice.parser.output_tokens
