"""Stage 6, respond (Chat Completions): chat-level deltas → `chat.completion.chunk` SSE bytes, or the
non-stream `chat.completion` body.

The streaming writer builds each chunk from precomputed byte fragments plus `orjson.dumps` of the
strings, so the per-token path constructs no models. Rules (REFERENCE §3.3): the first chunk carries the
role; one chunk per run of same-kind deltas; a tool call's opener carries id, type and name, its first
argument piece may ride along, and no chunk holds two entries with the same index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from ...pipeline.parse_output import CONTENT, REASONING_TEXT, TOOL_ARGS, TOOL_OPEN, ChoiceOutput
from ...pipeline.text_output import TextChoiceOutput
from ...sse import DATA_FIELD, EVENT_END

_dumps = orjson.dumps


def reasoning_keys(mode: str) -> tuple[str, ...]:
    if mode == "reasoning_content":
        return ("reasoning_content",)
    if mode == "reasoning":
        return ("reasoning",)
    return ("reasoning_content", "reasoning")


class ChatStreamWriter:
    """Serialises one chat completion's stream. Not thread-safe; one per request."""

    def __init__(
        self, completion_id: str, created: int, model: str, *, include_usage: bool, reasoning_mode: str
    ) -> None:
        head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._head = DATA_FIELD + _dumps(head)[:-1] + b',"choices":['
        self._tail = (b'],"usage":null}' if include_usage else b"]}") + EVENT_END
        self._reasoning_keys = [b'"' + k.encode() + b'":' for k in reasoning_keys(reasoning_mode)]
        # A delta chunk is `_leads[index] + delta + _delta_end`: two joins per token, nothing formatted.
        self._leads: dict[int, bytes] = {}
        self._delta_end = b'},"logprobs":null,"finish_reason":null}' + self._tail

    def role_chunk(self, index: int) -> bytes:
        return (
            self._head
            + b'{"index":%d,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}'
            % index
            + self._tail
        )

    def _choice(self, index: int, delta: bytes) -> bytes:
        lead = self._leads.get(index)
        if lead is None:
            lead = self._leads[index] = self._head + b'{"index":%d,"delta":{' % index
        return lead + delta + self._delta_end

    def _reasoning(self, value: bytes) -> bytes:
        keys = self._reasoning_keys
        return keys[0] + value if len(keys) == 1 else b",".join([k + value for k in keys])

    def deltas(self, index: int, deltas: list[tuple[Any, ...]]) -> bytes:
        """SSE bytes for a list of deltas of one choice: one chunk per run of same-kind deltas."""
        if len(deltas) == 1:  # one token per engine message: one text delta, one chunk
            delta = deltas[0]
            kind = delta[0]
            if kind == CONTENT:
                return self._choice(index, b'"content":' + _dumps(delta[1]))
            if kind == REASONING_TEXT:
                return self._choice(index, self._reasoning(_dumps(delta[1])))
        out: list[bytes] = []
        i = 0
        n = len(deltas)
        while i < n:
            kind = deltas[i][0]
            if kind == CONTENT or kind == REASONING_TEXT:
                j = i + 1
                while j < n and deltas[j][0] == kind:
                    j += 1
                text = deltas[i][1] if j == i + 1 else "".join(d[1] for d in deltas[i:j])
                value = _dumps(text)
                if kind == CONTENT:
                    out.append(self._choice(index, b'"content":' + value))
                else:
                    out.append(self._choice(index, self._reasoning(value)))
                i = j
            elif kind == TOOL_OPEN:
                _, call_index, call_id, name = deltas[i]
                j = i + 1
                args: list[str] = []
                while j < n and deltas[j][0] == TOOL_ARGS and deltas[j][1] == call_index:
                    args.append(deltas[j][2])
                    j += 1
                entry = {
                    "index": call_index,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": "".join(args)},
                }
                out.append(self._choice(index, b'"tool_calls":[' + _dumps(entry) + b"]"))
                i = j
            else:  # TOOL_ARGS
                call_index = deltas[i][1]
                j = i + 1
                while j < n and deltas[j][0] == TOOL_ARGS and deltas[j][1] == call_index:
                    j += 1
                text = deltas[i][2] if j == i + 1 else "".join(d[2] for d in deltas[i:j])
                out.append(
                    self._choice(
                        index,
                        b'"tool_calls":[{"index":%d,"function":{"arguments":' % call_index
                        + _dumps(text)
                        + b"}}]",
                    )
                )
                i = j
        return b"".join(out)

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return (
            self._head
            + b'{"index":%d,"delta":{},"logprobs":null,"finish_reason":' % index
            + _dumps(finish_reason)
            + b"}"
            + self._tail
        )

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        return self._head + b'],"usage":' + _dumps(usage) + b"}\n\n"


def chat_usage(choices: Sequence[ChoiceOutput | TextChoiceOutput], prompt_tokens: int) -> dict[str, Any]:
    """n > 1: the prompt counted once, completions summed."""
    prompt = max((c.prompt_tokens for c in choices), default=0) or prompt_tokens
    completion = sum(c.completion_tokens or c.parser.output_tokens for c in choices)
    reasoning = sum(c.parser.reasoning_tokens for c in choices)
    cached = max((c.cached_tokens for c in choices), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def chat_completion_body(
    completion_id: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceOutput | TextChoiceOutput],
    usage: dict[str, Any],
    reasoning_mode: str,
) -> dict[str, Any]:
    out_choices = []
    keys = reasoning_keys(reasoning_mode)
    for choice in choices:
        content = "".join(choice.content_parts) or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if choice.include_reasoning:
            reasoning = "".join(choice.reasoning_parts) or None
            for key in keys:
                message[key] = reasoning
        message["tool_calls"] = [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.text}}
            for call in choice.tool_calls
        ] or None
        out_choices.append(
            {
                "index": choice.index,
                "message": message,
                "logprobs": None,
                "finish_reason": choice.finish_reason,
            }
        )
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": out_choices,
        "usage": usage,
    }


class LogprobChatStreamWriter(ChatStreamWriter):
    """A `ChatStreamWriter` that puts each choice's pending logprobs on the next chunk it writes for
    that choice (`{"logprobs": {"content": [...]}}`), finish chunk included."""

    def __init__(self, choices: list[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._choices = choices
        self._current = -1

    def _logprobs_bytes(self, index: int) -> bytes:
        choice = self._choices[index]
        entries = choice.take_logprobs() if isinstance(choice, TextChoiceOutput) else []
        return b'{"content":' + orjson.dumps(entries) + b"}" if entries else b"null"

    def _chunk(self, index: int, delta: bytes, finish_reason: bytes) -> bytes:
        """A chunk of choice `index` carrying its pending logprobs; `finish_reason` is JSON."""
        logprobs = self._logprobs_bytes(index)
        opening = self._head + b'{"index":%d,"delta":{' % index + delta
        return (
            opening + b'},"logprobs":' + logprobs + b',"finish_reason":' + finish_reason + b"}" + self._tail
        )

    def _choice(self, index: int, delta: bytes) -> bytes:
        return self._chunk(index, delta, b"null")

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return self._chunk(index, b"", orjson.dumps(finish_reason))


def add_logprobs(body: dict[str, Any], choices: list[Any]) -> None:
    """Fill `choices[i].logprobs` of a non-stream chat body from text choices that collected them."""
    for out, choice in zip(body["choices"], choices, strict=True):
        if isinstance(choice, TextChoiceOutput):
            out["logprobs"] = {"content": choice.logprobs}
