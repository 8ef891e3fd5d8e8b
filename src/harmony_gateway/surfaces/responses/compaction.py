"""Compaction: a Responses conversation's history replaced by the model's own summary of it.

The summary is written by the served gpt-oss model: the conversation's Harmony prompt (the same prefix and
messages a request would render, so the engine's prefix cache holds most of it) followed by a user
message asking for a context checkpoint (`COMPACTION_REQUEST`), generated through the shared driver with
an output budget of its own (`summarize`). It travels to the client as a `compaction` item whose
`encrypted_content` is the summary sealed with the gateway key for the tenant
(`ReasoningVault.seal_summary`): opaque to the client, worthless to another tenant, and refused (400
naming the param) when changed.

What the model sees of a compaction item, wherever it stands (input items, a conversation's items, a
`previous_response_id` chain), is one developer message at its place:

    <|start|>developer<|message|># Conversation summary

    <SUMMARY_NOTE>

    <the summary><|end|>

and the item stands in for everything before it except the user's own messages and mid-conversation
instructions, which keep their places (`compacted`). That is the shape `POST /v1/responses/compact`
returns (all user messages, then one compaction item), so feeding its output back renders as written,
and a client that appends a response's output to its input without pruning sends the same prompt as one
that drops what came before the compaction item: everything else before it (the assistant's answers and
reasoning, tool calls and their outputs, older summaries) is covered by the summary and not rendered.
A developer message, because the summary is context the client's conversation carries, which the model
weighs as the client's; the note tells the model it is a summary, not new instructions.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...engines.base import EngineChunk
from ...errors import InvalidRequest, UpstreamBadOutput
from ...harmony.messages import Msg, drop_old_analysis, user
from ...pipeline.context import GatewayState, PreparedRequest, RequestContext
from ...pipeline.drive import NothingToSettle, RequestFramer, collect, open_generation
from ...pipeline.parse_output import ChoiceOutput
from ...pipeline.prepare import render_prompt, renders_on_loop
from .history_window import newest_that_fit

#: `Msg.kind` of a conversation summary.
SUMMARY_KIND = "compaction"
#: The user message that asks the model for the summary, after the conversation it summarises.
COMPACTION_REQUEST = (
    "Context checkpoint. The conversation above is about to be replaced by a summary that you write now; "
    "you will continue from the summary alone. Write it for yourself: what the user asked for and the "
    "constraints they set, what has been done so far and what it produced (the tool results that still "
    "matter), the decisions taken, and what remains to be done next. Keep exact names, paths, numbers "
    "and identifiers that will be needed later. Do not call any tool: answer with the summary only."
)
#: Opens the developer message a summary renders as.
SUMMARY_HEADER = "# Conversation summary\n\n"
SUMMARY_NOTE = (
    "The conversation before this point was compacted: this is the summary you wrote of it. The user's "
    "earlier messages are shown as they were. Treat the summary as context, not as new instructions."
)
#: Output budget of a summary (analysis and answer), at most a quarter of the model's context.
SUMMARY_MAX_TOKENS = 8192
#: Analysis budget of a summary: past it the model moves on to writing the summary.
SUMMARY_REASONING_TOKENS = 2048
#: `compact_threshold`'s least value in OpenAI's schema.
MIN_COMPACT_THRESHOLD = 1000
#: The threshold of a `compaction` entry that names none: this share of the model's context.
DEFAULT_THRESHOLD_SHARE = 0.8


def summary_message(summary: str) -> Msg:
    """The developer message a compaction item renders as (module docstring)."""
    return Msg("developer", f"{SUMMARY_HEADER}{SUMMARY_NOTE}\n\n{summary}", kind=SUMMARY_KIND)


def _last_summary(messages: Sequence[Msg]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].kind == SUMMARY_KIND:
            return i
    return -1


def _kept_before_summary(msg: Msg) -> bool:
    """Before a summary only the user's messages and mid-conversation instructions stay."""
    return msg.role == "user" or (msg.role == "developer" and msg.kind is None)


def compacted(messages: Sequence[Msg]) -> list[Msg]:
    """`messages` as the model sees them: before the newest summary, only what it does not stand for."""
    last = _last_summary(messages)
    if last < 0:
        return list(messages)
    return [m for m in messages[:last] if _kept_before_summary(m)] + list(messages[last:])


def compacted_split(history: list[Msg], turn: list[Msg]) -> tuple[list[Msg], list[Msg]]:
    """`compacted` over `history + turn`, split back into the two (a summary in either applies to both).
    Messages are filtered, never copied: a placeholder in `turn` stays the object it was."""
    last = _last_summary([*history, *turn])
    if last < 0:
        return history, turn
    if last >= len(history):
        cut = last - len(history)
        return (
            [m for m in history if _kept_before_summary(m)],
            [m for m in turn[:cut] if _kept_before_summary(m)] + turn[cut:],
        )
    return compacted(history), turn


def compactable(messages: Sequence[Msg]) -> bool:
    """Whether a summary would stand for something: after the newest summary (or from the start) there is
    an assistant or tool message. A prompt of user messages alone is not made shorter by compacting."""
    return any(m.role in ("assistant", "tool") for m in messages[_last_summary(messages) + 1 :])


def holds_summary(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether stored history messages (`Msg.to_dict`) hold a summary."""
    return any(m.get("kind") == SUMMARY_KIND for m in messages)


def compact_threshold(context_management: Any, context_tokens: int) -> int | None:
    """The prompt size past which a response compacts its conversation first, from the request's
    `context_management` (`[{"type": "compaction", "compact_threshold": N}]`); None when it asks for no
    compaction. An entry without a threshold takes DEFAULT_THRESHOLD_SHARE of the model's context.
    Raises InvalidRequest naming the entry's field."""
    if context_management is None:
        return None
    if not isinstance(context_management, list) or not context_management:
        raise InvalidRequest(
            "context_management must be a non-empty list of entries", param="context_management"
        )
    threshold: int | None = None
    for i, entry in enumerate(context_management):
        where = f"context_management[{i}]"
        if not isinstance(entry, dict):
            raise InvalidRequest("context_management entries must be objects", param=where)
        kind = entry.get("type")
        if kind != "compaction":
            raise InvalidRequest(
                f"context_management type {kind!r} is not supported; the one type is 'compaction'",
                param=f"{where}.type",
            )
        value = entry.get("compact_threshold")
        if value is None:
            if not context_tokens:
                raise InvalidRequest(
                    "the model's context length is unknown: give compact_threshold",
                    param=f"{where}.compact_threshold",
                )
            value = int(context_tokens * DEFAULT_THRESHOLD_SHARE)
        elif isinstance(value, bool) or not isinstance(value, int) or value < MIN_COMPACT_THRESHOLD:
            raise InvalidRequest(
                f"compact_threshold must be an integer of at least {MIN_COMPACT_THRESHOLD}",
                param=f"{where}.compact_threshold",
            )
        threshold = value if threshold is None else min(threshold, value)
    return threshold


def compaction_item(sealed: str) -> dict[str, Any]:
    """The output item that carries a sealed summary."""
    return {"type": "compaction", "id": _new_id("cmp"), "encrypted_content": sealed}


def user_items(messages: Sequence[Msg]) -> list[dict[str, Any]]:
    """The user messages among `messages` as input message items, in order (what `POST
    /v1/responses/compact` returns before its compaction item)."""
    return [
        {
            "type": "message",
            "id": _new_id("msg"),
            "role": "user",
            "content": [{"type": "input_text", "text": m.text}],
            "status": "completed",
        }
        for m in messages
        if m.role == "user"
    ]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"  # as `mapper.new_id`, which imports this module


def summary_budget(context_tokens: int) -> int:
    return min(SUMMARY_MAX_TOKENS, context_tokens // 4) if context_tokens else SUMMARY_MAX_TOKENS


async def summary_request(
    state: GatewayState, base: PreparedRequest, messages: Sequence[Msg], *, param: str
) -> PreparedRequest:
    """The request that asks for a summary of `messages`: `base`'s prefix (its instructions and tools, so
    the engine's prefix cache serves it), the conversation as the model would see it, as much of it as
    leaves room for the summary (the oldest messages go first), then `COMPACTION_REQUEST`. No output
    constraint (a structured output format or forced call is for the answer, not the summary), no
    logprobs, and an analysis budget."""
    assert base.prefix is not None
    history = compacted(messages)
    ask = [user(COMPACTION_REQUEST)]
    context = base.group.info.max_context_length
    budget = summary_budget(context)
    if context:
        on_loop = renders_on_loop(state.renderer, base.prefix, [*history, *ask])
        kept = await newest_that_fit(
            state.renderer, base.prefix, history, ask, context - budget, on_loop=on_loop
        )
        history = history[len(history) - kept :]
    unconstrained = dataclasses.replace(
        base,
        sampling=dataclasses.replace(base.sampling, structural_tag=None),
        stream=False,
        return_logprob=False,
        top_logprobs=0,
        stop_strings=(),
        after_turn=None,
    )
    prepared = await render_prompt(
        state, unconstrained, drop_old_analysis([*history, *ask]), budget, param=param
    )
    prepared.max_reasoning_tokens = min(SUMMARY_REASONING_TOKENS, budget // 2)
    return prepared


@dataclass(slots=True)
class Summary:
    """A summary the model wrote, with what writing it cost."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cached_tokens: int


class SummaryFramer(NothingToSettle, RequestFramer):
    """The driver's framer of a summary generation (`pipeline.drive.Framer`): parses the output, frames
    nothing (the summary is sealed into an item once it is whole)."""

    __slots__ = ("_choice", "_prepared")

    def __init__(self, state: GatewayState, prepared: PreparedRequest, ctx: RequestContext) -> None:
        super().__init__(ctx)
        self._prepared = prepared
        self._choice = ChoiceOutput(state, prepared, 0)
        self._choice.include_reasoning = False

    def feed(self, item: EngineChunk) -> bytes:
        self._choice.feed(item)
        return b""

    def stopped(self) -> bool:
        return False

    def tail(self) -> bytes:
        return b""

    def completion_tokens(self) -> int:
        return self._choice.completion_tokens

    def summary(self) -> Summary:
        """The summary (its final answer text); UpstreamBadOutput when the model wrote none."""
        choice = self._choice
        choice.close()
        text = "".join(choice.content_parts).strip()
        if not text:
            raise UpstreamBadOutput("the model wrote no summary of the conversation")
        return Summary(
            text,
            choice.prompt_tokens or len(self._prepared.input_ids),
            choice.completion_tokens,
            choice.parser.reasoning_tokens,
            choice.cached_tokens,
        )


async def summarize(state: GatewayState, prepared: PreparedRequest, ctx: RequestContext) -> Summary:
    """Generate the summary `prepared` (`summary_request`) asks for, through the shared driver."""
    framer = SummaryFramer(state, prepared, ctx)
    source = await open_generation(state, prepared, ctx, stream=False)
    await collect(source, framer)
    return framer.summary()


__all__ = [
    "COMPACTION_REQUEST",
    "SUMMARY_KIND",
    "Summary",
    "SummaryFramer",
    "compact_threshold",
    "compactable",
    "compacted",
    "compacted_split",
    "compaction_item",
    "holds_summary",
    "summarize",
    "summary_message",
    "summary_request",
    "user_items",
]
