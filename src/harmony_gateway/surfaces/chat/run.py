"""Chat Completions planned for the driver (`pipeline/drive.answer`): the prepared request, its choices
and the framer of the chosen body, `chat.completion` JSON or `chat.completion.chunk` events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from ...engines.base import EngineChunk
from ...pipeline.context import GatewayState, PreparedRequest, RequestContext
from ...pipeline.drive import Generation, NothingToSettle, Planned, RequestFramer, open_generation
from ...pipeline.parse_output import ChoiceOutput
from ...pipeline.prepare import prompt_cache_key_of
from ...pipeline.reasoning_budget import budget_exceeded
from ...pipeline.text_output import TextChoiceOutput, text_parser_stats
from ...sse import DONE
from .framer import ChatStreamWriter, LogprobChatStreamWriter, add_logprobs, chat_completion_body, chat_usage
from .mapper import prepare_chat
from .types import ChatCompletionRequest
from .upstream import attach_harmony_upstream, is_text_group

#: One choice's output: Harmony token ids (`ChoiceOutput`) or text (`TextChoiceOutput`: non-Harmony
#: models, HTTP upstreams).
Choice = ChoiceOutput | TextChoiceOutput


def _choices(state: GatewayState, prepared: PreparedRequest, include_reasoning: bool) -> list[Choice]:
    choices: list[Choice] = []
    for i in range(prepared.n):
        choice = (
            ChoiceOutput(state, prepared, i)
            if prepared.output_adapter is None
            else TextChoiceOutput(state, prepared, i)
        )
        choice.include_reasoning = include_reasoning
        choices.append(choice)
    return choices


async def prepare_chat_request(
    state: GatewayState, request: ChatCompletionRequest, ctx: RequestContext
) -> PreparedRequest:
    """The request's model group, routing hints and prepared prompt (what the inspector shows, too)."""
    group = state.fleet.group(request.model)
    ctx.model = group.name
    if ctx.routing_key is None:
        ctx.routing_key = request.user  # consistent_hash keeps one user's turns on one KV cache
    ctx.prompt_cache_key = prompt_cache_key_of(request)  # hook: prompt_cache_key routing
    return await prepare_chat(state, request, group, owner=ctx.owner)


async def inspect_chat(
    state: GatewayState, body: dict[str, Any], ctx: RequestContext, notes: list[str]
) -> PreparedRequest:
    """The inspector's view of a chat request: prepared as `plan_chat` prepares it, not dispatched."""
    return await prepare_chat_request(state, ChatCompletionRequest.model_validate(body), ctx)


async def plan_chat(state: GatewayState, request: ChatCompletionRequest, ctx: RequestContext) -> Planned:
    """A chat request prepared (the mapper's Harmony turn, or the chat-template path) with its framer:
    chunks as they form when streaming, else one `chat.completion` body."""
    prepared = await prepare_chat_request(state, request, ctx)
    group = prepared.group
    if prepared.harmony and is_text_group(group):
        attach_harmony_upstream(state, prepared, request)  # an HTTP upstream: Harmony as text
    ctx.prompt_tokens = len(prepared.input_ids)
    completion_id = "chatcmpl-" + ctx.request_id
    created = int(time.time())
    choices = _choices(state, prepared, request.include_reasoning)
    if prepared.output_adapter is not None:
        ctx.text_stats = text_parser_stats(choices)  # read once, at the end, for metrics
    elif prepared.harmony:
        ctx.parsers = [
            c.parser for c in choices if isinstance(c, ChoiceOutput)
        ]  # read once, at the end, for metrics
    # Streaming from the engine lets the gateway stop early on a client stop string.
    engine_stream = request.stream or bool(prepared.stop_strings)

    def open_stream() -> Awaitable[AsyncIterator[EngineChunk]]:
        return open_generation(state, prepared, ctx, stream=engine_stream)

    if not request.stream:
        collector = ChatCollector(prepared, choices)

        async def body() -> dict[str, Any]:
            for choice in choices:
                choice.close()
                if prepared.after_turn is not None:
                    await prepared.after_turn(choice)  # hook: restorable analysis of tool-call turns
            usage = chat_usage(choices, len(prepared.input_ids))
            _note_budget(usage, prepared, ctx)
            out = chat_completion_body(
                completion_id, created, group.name, choices, usage, state.settings.reasoning_fields
            )
            if prepared.return_logprob:
                add_logprobs(out, choices)
            return out

        return Generation(open_stream, collector, body=body)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    mode = state.settings.reasoning_fields
    writer = (
        LogprobChatStreamWriter(
            choices, completion_id, created, group.name, include_usage=include_usage, reasoning_mode=mode
        )
        if prepared.return_logprob
        else ChatStreamWriter(
            completion_id, created, group.name, include_usage=include_usage, reasoning_mode=mode
        )
    )
    framer = ChatFramer(prepared, ctx, writer, choices, include_usage)

    def head() -> bytes:
        return b"".join(writer.role_chunk(i) for i in range(len(choices)))

    return Generation(open_stream, framer, head=head)


class ChatCollector(NothingToSettle):
    """Chat Completions as one JSON body: the choices parse every chunk; the body is built after."""

    __slots__ = ("_choices", "_stops")

    def __init__(self, prepared: PreparedRequest, choices: list[Choice]) -> None:
        self._choices = choices
        self._stops = bool(prepared.stop_strings)

    def feed(self, chunk: EngineChunk) -> bytes:
        self._choices[chunk.index].feed(chunk)
        return b""

    def stopped(self) -> bool:
        return self._stops and all(c.finished or c.stop_hit for c in self._choices)

    def tail(self) -> bytes:
        return b""

    def error(self, exc: BaseException) -> bytes:
        return b""  # never streamed: a failure is the HTTP error

    def completion_tokens(self) -> int:
        return sum(c.completion_tokens or c.parser.output_tokens for c in self._choices)


class ChatFramer(RequestFramer):
    """Chat Completions chunks: deltas per engine chunk, a finish chunk per choice as it ends (a stop
    string ends it early), then usage when asked and `[DONE]`; a failure is the error chunk."""

    __slots__ = (
        "_choices",
        "_emitted",
        "_ended",
        "_include_usage",
        "_prepared",
        "_writer",
        "unsettled",
    )

    def __init__(
        self,
        prepared: PreparedRequest,
        ctx: RequestContext,
        writer: ChatStreamWriter,
        choices: list[Choice],
        include_usage: bool,
    ) -> None:
        super().__init__(ctx)
        self._prepared = prepared
        self._writer = writer
        self._choices = choices
        self._emitted = [False] * len(choices)
        self._include_usage = include_usage
        self._ended: list[Choice] = []  # finished choices whose after-turn work is due
        self.unsettled = False

    def _ending(self, choice: Choice) -> None:
        if self._prepared.after_turn is not None:
            self._ended.append(choice)
            self.unsettled = True

    async def settle(self) -> None:
        """The after-turn work (restorable analysis) of the choices that just ended, before their finish
        chunks go out."""
        ended, self._ended = self._ended, []
        self.unsettled = False
        after_turn = self._prepared.after_turn
        for choice in ended:
            if after_turn is not None:
                await after_turn(choice)

    def feed(self, chunk: EngineChunk) -> bytes:
        writer = self._writer
        index = chunk.index
        choice = self._choices[index]
        deltas = choice.feed(chunk)
        out = writer.deltas(index, deltas) if deltas else b""
        if (choice.finished or choice.stop_hit) and not self._emitted[index]:
            if choice.stop_hit:
                out += writer.deltas(index, choice.close())
            self._ending(choice)
            self._emitted[index] = True
            out += writer.finish_chunk(index, choice.finish_reason)
        return out

    def stopped(self) -> bool:
        return bool(self._prepared.stop_strings) and all(self._emitted)

    def tail(self) -> bytes:
        writer = self._writer
        tail = b""
        for choice in self._choices:
            if not self._emitted[choice.index]:
                tail += writer.deltas(choice.index, choice.close())
                self._ending(choice)
                tail += writer.finish_chunk(choice.index, choice.finish_reason)
        if self._include_usage:
            usage = chat_usage(self._choices, len(self._prepared.input_ids))
            _note_budget(usage, self._prepared, self._ctx)
            tail += writer.usage_chunk(usage)
        return tail + DONE

    def completion_tokens(self) -> int:
        return sum(c.completion_tokens or c.parser.output_tokens for c in self._choices)


def _note_budget(usage: dict[str, Any], prepared: PreparedRequest, ctx: RequestContext) -> None:
    """With a reasoning budget, usage says whether it cut the analysis (see pipeline/reasoning_budget.py)."""
    if prepared.max_reasoning_tokens is not None:
        usage["completion_tokens_details"]["reasoning_budget_exceeded"] = budget_exceeded(ctx)
