"""Runs a Messages request: the mapper's Harmony turn (or the chat-template path) through the shared
driver, framed as Anthropic's JSON body or stream; and `count_tokens`, the same prompt counted."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any

from ...engines.base import EngineChunk
from ...errors import InvalidRequest
from ...pipeline.context import GatewayState, PreparedRequest, RequestContext
from ...pipeline.drive import Generation, Planned, open_generation
from ...pipeline.parse_output import ChoiceOutput
from ...pipeline.text_output import TextChoiceOutput, text_parser_stats
from ..chat.upstream import is_text_group
from .framer import MessagesFramer, anthropic_usage, message_id, stop_reason
from .mapper import MessagesPlan, prepare_messages, resolve_group
from .types import CountTokensRequest, MessagesRequest


async def count_message_tokens(
    state: GatewayState, request: CountTokensRequest, *, owner: str
) -> dict[str, int]:
    group = resolve_group(state, request.model)
    if not group.harmony and is_text_group(group):
        raise InvalidRequest(
            f"POST /v1/messages/count_tokens is not available for model {group.name!r}: it is served by an "
            "HTTP upstream, whose chat template the gateway does not render",
            param="model",
        )
    plan = await prepare_messages(state, request, group, owner=owner)
    return {"input_tokens": len(plan.prepared.input_ids)}


async def prepare_message_request(
    state: GatewayState, request: MessagesRequest, ctx: RequestContext
) -> MessagesPlan:
    group = resolve_group(state, request.model)
    ctx.model = group.name
    return await prepare_messages(state, request, group, owner=ctx.owner)


async def inspect_messages(
    state: GatewayState, body: dict[str, Any], ctx: RequestContext, notes: list[str]
) -> PreparedRequest:
    """The inspector's view of a Messages request: prepared as `plan_messages` prepares it."""
    return (await prepare_message_request(state, MessagesRequest.model_validate(body), ctx)).prepared


async def plan_messages(state: GatewayState, request: MessagesRequest, ctx: RequestContext) -> Planned:
    """A Messages request prepared with its framer: Anthropic's stream events, or one Message body."""
    plan = await prepare_message_request(state, request, ctx)
    prepared = plan.prepared
    group = prepared.group
    ctx.prompt_tokens = len(prepared.input_ids)
    choice: ChoiceOutput | TextChoiceOutput
    if prepared.output_adapter is not None:  # other models, HTTP upstreams: text output
        choice = TextChoiceOutput(state, prepared, 0)
        ctx.text_stats = text_parser_stats([choice])
    else:
        choice = ChoiceOutput(state, prepared, 0)
        ctx.parsers = [choice.parser]
    choice.include_reasoning = plan.show_thinking
    # Streaming from the engine lets the gateway stop early on a client stop sequence.
    engine_stream = request.stream or bool(prepared.stop_strings)
    framer = MessagesFramer(prepared, ctx, choice, stream=request.stream, sign=plan.sign)

    def open_stream() -> Awaitable[AsyncIterator[EngineChunk]]:
        return open_generation(state, prepared, ctx, stream=engine_stream)

    async def body() -> dict[str, Any]:
        blocks = framer.blocks
        blocks.push(choice.close())
        blocks.close()
        if prepared.after_turn is not None:
            await prepared.after_turn(choice)  # hook: restorable analysis of tool-call turns
        reason, sequence = stop_reason(choice, prepared.stop_strings)
        return {
            "id": message_id(ctx),
            "type": "message",
            "role": "assistant",
            "model": group.name,
            "content": blocks.blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": anthropic_usage(choice, prepared, ctx),
        }

    return Generation(open_stream, framer, body=None if request.stream else body)
